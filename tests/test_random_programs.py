"""Random programs: gradients under ``compressing()`` bit-identical to those without it.

Each program is a short random sequence of ops over a pool of tensors (the input, and what
the ops before made), drawn from what the selection rule treats differently: the ReLU family
and what hides it (in-place ops, on views too; casts; checkpointing), squares and products
(recomputed at backward), views and slices of stored tensors (shared), and ops it never
stores. The loss sums every tensor made, so backward unpacks everything autograd saved. Three
steps under BitSparse follow one without it, so that the arena is measured, used, and reused.
Each program runs in float32, bfloat16 and float16.

In-place ops modify fresh clones only: a saved tensor modified in place is the subject of
``test_hooks.py``'s version tests (autograd raises; a compressed tensor restores the saved
values), not of a comparison of gradients.

On CUDA (``-m gpu``) the same programs run through the Triton codec and the arena's streams,
and the last step under ``torch.cuda.set_sync_debug_mode("error")`` wherever the program's
own ops run under it without BitSparse. A few of them, and those that once differed, also
run compiled whole, on the CPU and on CUDA, against the same compiled program without
BitSparse, and a few cut into parts that run eagerly or compiled each on its own (on both),
whose compiled parts save what eager parts made and the other way round.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import random

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise_equal
from torch.utils.checkpoint import checkpoint

import bitsparse
from bitsparse.bench.training import deterministic_kernels

ROWS, COLS = 48, 100
"""4800 elements: a whole tile of the format's 4096 and a partial one."""
PROGRAMS = 200
OPTIONS = [{}, {"sign_pack": True}, {"recompute_squares": False}, {"select": "all"}]


def _relu_half_in_place(t: torch.Tensor) -> torch.Tensor:
    """A clone whose first half of columns went through ``relu_`` on a view (autograd records
    the ReLU on the view's base as a copy, which hides it from the rule)."""
    out = t.clone()
    out[..., : t.shape[-1] // 2].relu_()
    return out


def _relu_without_grad(t: torch.Tensor) -> torch.Tensor:
    """A product with a ReLU output computed under ``torch.no_grad()`` (saved without a node)."""
    with torch.no_grad():
        r = torch.relu(t)
    return r * t


UNARY = {
    # The ReLU family, and the same hidden from the rule.
    "relu": torch.relu,
    "relu_": lambda t: t.clone().relu_(),
    "relu_half_in_place": _relu_half_in_place,
    "relu_then_slice": lambda t: t.clone().relu_()[:, 1:],
    "relu6": F.relu6,
    "hardtanh": lambda t: F.hardtanh(t, 0.0, 0.5),
    "clamp": lambda t: t.clamp(min=0),
    "clamp_min_": lambda t: t.clone().clamp_min_(0.0),
    "threshold": lambda t: F.threshold(t, 0.0, 0.0),
    "relu_of_bf16": lambda t: torch.relu(t.to(torch.bfloat16)),
    "dropout": lambda t: F.dropout(t, 0.3, True),
    "checkpointed_reglu": lambda t: checkpoint(lambda u: torch.relu(u) * u, t, use_reentrant=False),
    "masked_relu": lambda t: torch.relu(t).masked_fill(t > 1.0, 0.0),
    "where_relu": lambda t: torch.where(t > 0, t, torch.zeros_like(t)),
    # Squares: of a stored tensor, recomputed.
    "square": torch.square,
    "pow": lambda t: t.pow(2),
    "self_product": lambda t: t * t,
    "square_of_bf16_relu": lambda t: torch.relu(t.to(torch.bfloat16)).square(),
    "relu_square_row_sums": lambda t: torch.relu(t).square().sum(-1, keepdim=True) * t,
    # Views, slices and copies of what may be stored.
    "transpose": lambda t: t.t() if t.dim() == 2 else t,
    "reshape": lambda t: t.reshape(-1, t.shape[-1] // 2) if t.shape[-1] % 2 == 0 else t.reshape(-1),
    "every_other": lambda t: t[..., ::2],
    "narrow": lambda t: t.narrow(0, 1, t.shape[0] - 1),
    "permuted_3d": lambda t: t.view(t.shape[0], 2, -1).transpose(1, 2) if t.dim() == 2 and t.shape[1] % 2 == 0 else t,
    "contiguous": lambda t: t.contiguous(),
    "relu_rows": lambda t: torch.relu(t)[torch.arange(0, t.shape[0], 2, device=t.device)],
    "relu_split": lambda t: torch.relu(t).split(t.shape[0] // 2)[1] * 1.0,
    "relu_cat": lambda t: torch.cat([torch.relu(t), t]),
    "relu_max_pool": lambda t: F.max_pool1d(torch.relu(t).unsqueeze(0), 2).squeeze(0) if t.dim() == 2 else t,
    "relu_broadcast_product": lambda t: torch.relu(t) * t.sum(0, keepdim=True),
    # Never stored.
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "softmax": lambda t: torch.softmax(t, -1),
    "layer_norm": lambda t: F.layer_norm(t, t.shape[-1:]),
    "gelu": F.gelu,
    "to_float32": lambda t: t.float(),
    "shift": lambda t: t - 0.7,
    "neg": torch.neg,
    "relu_without_grad": _relu_without_grad,
}


BINARY = {
    "mul": torch.mul,
    "add": torch.add,
    "reglu": lambda a, b: torch.relu(a) * b,
    "reglu_reversed": lambda a, b: b * torch.relu(a),
    "relu2_glu": lambda a, b: torch.relu(a) ** 2 * b,
}


def random_program(seed: int) -> tuple[list[tuple], dict]:
    """Ops as (kind, op, operand choices in [0, 1)), the op a name of ``UNARY`` or ``BINARY``
    or the index of a weight; and the options to run them with."""
    rng = random.Random(seed)
    program = []
    for _ in range(rng.randint(3, 14)):
        kind = rng.random()
        if kind < 0.6:
            program.append(("unary", rng.choice(sorted(UNARY)), rng.random()))
        elif kind < 0.85:
            program.append(("binary", rng.choice(sorted(BINARY)), rng.random(), rng.random()))
        else:
            program.append(("linear", rng.randrange(3), rng.random()))
    return program, rng.choice(OPTIONS)


def made_by(ops, pool: list, weights) -> list:
    """The tensors ``ops`` make, in order, each op drawing its operands from ``pool`` and
    from what the ops before it made."""
    pool = list(pool)
    made = len(pool)
    for kind, op, *choices in ops:
        if kind == "unary":
            pool.append(UNARY[op](pool[int(choices[0] * len(pool))]))
        elif kind == "binary":
            a = pool[int(choices[0] * len(pool))]
            alike = [t for t in pool if t.shape == a.shape and t.dtype == a.dtype]
            pool.append(BINARY[op](a, alike[int(choices[1] * len(alike))]))
        else:
            fitting = [t for t in pool if t.dim() == 2 and t.shape[-1] == COLS]
            a = fitting[int(choices[0] * len(fitting))]
            pool.append(a @ weights[op].to(a.dtype))
    return pool[made:]


def loss_of(pool) -> torch.Tensor:
    """The sum of every tensor's mean square."""
    return sum(t.float().square().mean() for t in pool if t.requires_grad)


def run(program, x: torch.Tensor, weights) -> torch.Tensor:
    """The loss of ``program`` on ``x``."""
    return loss_of([x, *made_by(program, [x], weights)])


def step(forward, x, weights, context, seed: int, backwards: int = 1):
    """Gradients of one ``forward(x, weights)`` under ``context`` (dropout seeded) and
    ``backwards`` backwards of its loss (accumulated), or None when nothing requires them."""
    for t in (x, *weights):
        t.grad = None
    torch.manual_seed(seed)
    with context:
        loss = forward(x, weights)
    if not isinstance(loss, torch.Tensor):
        return None
    for _ in range(backwards - 1):
        loss.backward(retain_graph=True)
    loss.backward()
    return [None if t.grad is None else t.grad.clone() for t in (x, *weights)]


def inputs(seed: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    shift = [0.0, -1.0][seed % 2]  # about 50% and 85% zeros after a ReLU
    x = (torch.randn(ROWS, COLS, generator=g) + shift).to(device, dtype).requires_grad_(seed % 5 != 0)
    weights = [torch.nn.Parameter((torch.randn(COLS, COLS, generator=g) / 10).to(device, dtype)) for _ in range(3)]
    return x, weights


def assert_same_gradients(got, expected) -> None:
    assert (got is None) == (expected is None)
    for actual, wanted in zip(got or [], expected or []):
        assert (actual is None) == (wanted is None)
        if actual is not None:
            assert_bitwise_equal(actual, wanted)


def check_program(seed: int, device="cpu", dtype=torch.float32, no_sync: bool = False, backwards: int = 1):
    """Dense gradients, then three steps under ``compressing()`` with the same bits, each of
    which leaves no stored tensor alive; the last step's statistics."""
    program, options = random_program(seed)
    forward = functools.partial(run, program)
    x, weights = inputs(seed, device, dtype)
    expected = step(forward, x, weights, contextlib.nullcontext(), seed, backwards)
    for i in range(3):
        # A fresh session's first step only measures, keeping every tensor as it is; the
        # steps after it store into an arena of 16 MiB.
        compressing = functools.partial(
            bitsparse.compressing, min_numel=64, capacity="auto" if i == 0 else 1 << 24, **options
        )
        sync_check = no_sync and i == 2
        if sync_check:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = step(forward, x, weights, compressing(), seed, backwards)
        finally:
            if sync_check:
                torch.cuda.set_sync_debug_mode(0)
        assert_same_gradients(got, expected)
        assert bitsparse.stats().tensors_alive == 0
    return bitsparse.stats()


@pytest.fixture(autouse=True)
def fresh_session():
    """A session without arenas or learned sites for each test, where no graph of a test
    before is alive (the traceback of one that failed may keep it)."""
    if bitsparse.stats().tensors_alive:
        gc.collect()
    if not bitsparse.stats().tensors_alive:
        bitsparse.reset()
    yield


DTYPE_NAMED = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes the programs run in, by the names that test ids and the cases below use."""

DTYPES = pytest.mark.parametrize("dtype", list(DTYPE_NAMED.values()), ids=list(DTYPE_NAMED))


@DTYPES
@pytest.mark.parametrize("seed", range(PROGRAMS))
def test_random_program_gradients_are_bit_identical(seed, dtype):
    check_program(seed, dtype=dtype)


@pytest.mark.parametrize("seed", range(0, PROGRAMS, 4))
def test_random_program_gradients_of_two_backwards_are_bit_identical(seed):
    """``retain_graph=True``: the second backward restores every saved tensor again."""
    check_program(seed, backwards=2)


def test_random_programs_store_recompute_and_share():
    """The programs above exercise what they are for: tensors stored, squares and products
    recomputed, tensors saved twice shared (counts of their last steps)."""
    compressed = recomputed = shared = 0
    for seed in range(PROGRAMS // 4):
        stats = check_program(seed)
        compressed += stats.tensors_compressed
        recomputed += stats.tensors_recomputed
        shared += stats.tensors_deduplicated
        bitsparse.reset()
    assert compressed and recomputed and shared, (compressed, recomputed, shared)


def _dense_runs_without_sync(program, x, weights, seed) -> bool:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(functools.partial(run, program), x, weights, contextlib.nullcontext(), seed)
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@DTYPES
@pytest.mark.parametrize("seed", range(PROGRAMS))
def test_random_program_gradients_are_bit_identical_on_cuda(seed, dtype):
    program, _ = random_program(seed)
    with deterministic_kernels():
        no_sync = _dense_runs_without_sync(program, *inputs(seed, "cuda", dtype), seed)
        check_program(seed, "cuda", dtype, no_sync)


FOUND_COMPILED = [(53, "bf16"), (56, "bf16"), (58, "bf16"), (65, "bf16"), (87, "bf16"), (122, "bf16"), (136, "bf16")]
FOUND_COMPILED += [(226, "fp32"), (160, "fp32")]
"""Programs (and dtypes) whose gradients compiled under BitSparse once differed from compiled
dense's: the partitioner, told to save a ReLU output that the backward does not read itself,
saved values computed from it instead; a ReLU whose input the backward reads for more than
the ReLU was restored where inductor had fused its recomputation with that input's other
uses (``hooks.compiled.steer``); a restore placed amid ops that inductor fuses into one kernel
without it split them (``hooks.graph_passes.place_ops``; 53, ``select="all"``); before PyTorch
2.14, inductor's CPU scheduler ran a kernel before the restore that filled a buffer it read
(``hooks.graph_passes.recompute_keeping_mutations``; 226, ``select="all"``, where the restore's
placement hides it too); a square of a ReLU output that nothing stores, told to be recomputed,
changed how inductor fused the backward (160, whose square is bf16)."""

FOUND_COMPILED_ALL = [(439, "bf16"), (306, "bf16")]
"""Programs whose gradients differed with ``select="all"`` in place of their options: a kernel
run before the restore that filled a buffer it read, as 226's (439); zeros that the forward
shared with the backward's scatter, stored, which inductor then scattered into in place and
computed the kernel around it in two passes (306, ``hooks.compiled._FILLS``)."""


COMPILED = [(0, "fp32", None), (1, "bf16", None)]
COMPILED += [(seed, dtype, None) for seed, dtype in FOUND_COMPILED]
COMPILED += [(seed, dtype, "all") for seed, dtype in FOUND_COMPILED_ALL]


def check_compiled_program(seed: int, device: str, dtype: str, select: str | None) -> None:
    """The program compiled whole (``torch.compile``, inductor), with and without
    ``compressing()`` (with the program's options, or ``select`` in place of them): two steps
    under BitSparse with the gradients of the one without it, bit for bit."""
    import torch._dynamo

    program, options = random_program(seed)
    if select is not None:
        options = {"select": select}
    x, weights = inputs(seed, device, DTYPE_NAMED[dtype])
    torch._dynamo.reset()
    forward = torch.compile(functools.partial(run, program))
    expected = step(forward, x, weights, contextlib.nullcontext(), seed)
    for _ in range(2):
        got = step(forward, x, weights, bitsparse.compressing(min_numel=64, capacity=1 << 24, **options), seed)
        assert_same_gradients(got, expected)


@pytest.mark.parametrize("seed, dtype, select", COMPILED)
def test_compiled_random_program_gradients_are_bit_identical_to_compiled_dense(seed, dtype, select):
    check_compiled_program(seed, "cpu", dtype, select)


def in_parts(seed: int):
    """Program ``seed`` cut into parts of one to four ops, about half of them compiled, each
    on its own (``torch.compile``), and its options; the forward runs the parts in turn, each
    drawing on what the parts before it made."""
    program, options = random_program(seed)
    rng = random.Random(-seed)
    parts, done = [], 0
    while done < len(program):
        size = rng.randint(1, 4)
        parts.append(program[done : done + size])
        done += size
    eager = [functools.partial(made_by, ops) for ops in parts]
    runs = [torch.compile(part) if rng.random() < 0.5 else part for part in eager]

    def forward(x, weights):
        pool = [x]
        for part in runs:
            pool += part(pool, weights)
        return loss_of(pool)

    return forward, options


MIXED = [(4, "bf16"), (6, "fp32"), (10, "fp32"), (27, "bf16")]
"""Programs whose compiled parts and eager parts both store tensors (options:
``recompute_squares=False`` for 4 and 10, ``select="all"`` for 6, ``sign_pack=True`` for 27)."""


def check_program_in_parts(seed: int, device: str, dtype: str) -> None:
    """``in_parts(seed)`` with and without ``compressing()``: a fresh session's first step,
    which only measures, a step that stores, and one whose arena is full, each with the
    gradients of the same parts without BitSparse, bit for bit."""
    import torch._dynamo

    torch._dynamo.reset()
    forward, options = in_parts(seed)
    x, weights = inputs(seed, device, DTYPE_NAMED[dtype])
    # Each compiled part is an entry of the code of ``made_by``, with the hooks and without:
    # past Dynamo's default limit of 8 entries, parts would run eagerly in one mode and
    # compiled in the other; past this one, Dynamo raises.
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        expected = step(forward, x, weights, contextlib.nullcontext(), seed)
        for capacity in ("auto", 1 << 24, 4096):
            got = step(forward, x, weights, bitsparse.compressing(min_numel=64, capacity=capacity, **options), seed)
            assert_same_gradients(got, expected)
            stats = bitsparse.stats()
            assert stats.tensors_alive == 0
            if capacity == 1 << 24:
                assert stats.tensors_compressed


@pytest.mark.parametrize("seed, dtype", MIXED)
def test_random_program_in_eager_and_compiled_parts_gives_the_same_gradients(seed, dtype):
    check_program_in_parts(seed, "cpu", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed, dtype, select", COMPILED + [(seed, "bf16", None) for seed in range(2, 12)])
def test_compiled_random_program_gradients_are_bit_identical_on_cuda(seed, dtype, select):
    """The same on CUDA: inductor's Triton kernels, the Triton codec, and the fused stores
    and restores of ReLU outputs that are squared (CUDA only)."""
    with deterministic_kernels():
        check_compiled_program(seed, "cuda", dtype, select)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed, dtype", MIXED + [(seed, "bf16") for seed in (2, 3, 7, 8, 11)])
def test_random_program_in_eager_and_compiled_parts_gives_the_same_gradients_on_cuda(seed, dtype):
    """Programs in parts on CUDA (those of the CPU and five more that store): eager parts
    store through the Triton codec and the arena's streams, compiled parts through inductor's
    calls of the same ops."""
    with deterministic_kernels():
        check_program_in_parts(seed, "cuda", dtype)
