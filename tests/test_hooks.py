"""The training API on the CPU: exact gradients with compressed saved activations, statistics,
enable()/disable(), option errors and threads.

Every gradient test compares a plain run with runs inside ``bitsparse.compressing()`` bit for
bit (two compressed steps in a row, so the arena is reused), and checks that compression
really happened, so that a test cannot pass by compressing nothing.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import linecache
import pathlib
import sys
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import NoRoomForBuffers, assert_bitwise_equal
from torch.utils.checkpoint import checkpoint

import bitsparse
from bitsparse import Options, Stats
from bitsparse.allocator import Arena, pool
from bitsparse.allocator import arena as arena_module
from bitsparse.allocator.arena import DEMAND_STEPS
from bitsparse.bench.pipeline import PerForward, one_f_one_b, run_iteration
from bitsparse.codecs import get_codec, torch_codec
from bitsparse.format import TileGeometry, compressed_nbytes, dtype_spec
from bitsparse.hooks import handles, manager
from bitsparse.hooks.spans import SpanIndex, span_of

MIN_NUMEL = 1024
"""Small enough that the CPU-sized models below get compressed (the default is 65536)."""
ARENA = 1 << 20
"""An explicit arena, so that a test's first step compresses (the default first measures)."""
OPTIONS = {"min_numel": MIN_NUMEL, "capacity": ARENA}


def alive() -> int:
    """Compressed tensors autograd still holds, of any step."""
    return bitsparse.stats().tensors_alive


def hooks_installed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _settle() -> None:
    """Free whatever dead graphs still hold, then forget arenas and learned state."""
    if alive():
        gc.collect()  # only when needed: a full collection takes a noticeable time
    if not alive():
        bitsparse.reset()


@pytest.fixture(autouse=True)
def clean_session():
    _settle()
    try:
        yield
    finally:
        try:
            bitsparse.disable()
        finally:
            _settle()
            assert not bitsparse.is_enabled()
            assert not hooks_installed(), "hooks left installed"
            assert alive() == 0, "stored tensors outlived the test's graphs"


# --------------------------------------------------------------------------------------------
# Models


def mlp(d_in=32, hidden=256, d_out=10, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out)
    )


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block with a ReLU^2 MLP, written one of three ways."""

    def __init__(self, d: int, variant: int, norm: type):
        super().__init__()
        self.variant = variant
        self.norm1, self.norm2 = norm(d), norm(d)
        self.attn = Attention(d, heads=4)
        self.fc = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        h = self.fc(self.norm2(x))
        if self.variant == 0:
            h = F.relu(h).square()
        elif self.variant == 1:
            h = torch.square(torch.relu(h))
        else:
            h = h.relu_() ** 2  # in place on a view of the Linear's output: CopySlices
        return x + self.down(h)


def transformer(d=32, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        Block(d, 0, nn.LayerNorm), Block(d, 1, nn.RMSNorm), Block(d, 2, nn.LayerNorm), nn.LayerNorm(d)
    )


def convnet(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def mlp_input(seed=1, batch=64, d_in=32):
    return torch.randn(batch, d_in, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def sequence_input(seed=1, d=32):
    return torch.randn(4, 16, d, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def image_input(seed=1):
    return torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(seed), requires_grad=True)


class MarkedReLU(torch.autograd.Function):
    """A ReLU autograd cannot tell apart (torch.where), flagged with bitsparse.mark."""

    @staticmethod
    def forward(ctx, x, use_mark):
        out = torch.where(x > 0, x, torch.zeros_like(x))
        if use_mark:
            bitsparse.mark(out)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (out > 0), None


class CustomMLP(nn.Module):
    def __init__(self, use_mark: bool):
        super().__init__()
        torch.manual_seed(0)
        self.use_mark = use_mark
        self.fc1, self.fc2 = nn.Linear(32, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(MarkedReLU.apply(self.fc1(x), self.use_mark))


# --------------------------------------------------------------------------------------------
# Running and comparing


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def grads(model: nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.detach().clone() for t in [*model.parameters(), *inputs]]


def zero_grads(model: nn.Module, *inputs: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    for x in inputs:
        x.grad = None


def assert_same_grads(actual, expected) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a is None) == (e is None), f"gradient {i}: {a is None} vs {e is None}"
        if a is not None:
            assert_bitwise_equal(a, e)  # NaNs too, payloads included


def train_step(model, x, ctx, autocast=False):
    zero_grads(model, x)
    with ctx:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            out = model(x)
    loss_of(out).backward()
    return grads(model, x)


@contextlib.contextmanager
def seeded(ctx):
    """``ctx``, entered after seeding the generator that dropout draws from."""
    torch.manual_seed(1)
    with ctx:
        yield


def check_exact(model, x, steps=2, autocast=False, **options) -> list[Stats]:
    """Plain gradients, then ``steps`` compressed steps with the same gradients; their stats."""
    options = {**OPTIONS, **options}
    expected = train_step(model, x, contextlib.nullcontext(), autocast)
    stats = []
    for _ in range(steps):
        got = train_step(model, x, bitsparse.compressing(**options), autocast)
        assert_same_grads(got, expected)
        stats.append(Stats(**{k: v for k, v in bitsparse.stats().as_dict().items() if k != "ratio"}))
    assert alive() == 0
    return stats


def without_traceback(fn, *args, **kwargs):
    """Call ``fn``; re-raise a failure without its traceback, whose frames would keep a
    half-run graph (and its stored tensors) alive for as long as pytest keeps the report."""
    try:
        return fn(*args, **kwargs)
    except (AssertionError, RuntimeError) as e:
        error = type(e)(str(e))
    raise error


def check_consistent(s: Stats) -> None:
    """Every saved tensor is counted once: compressed, shared, recomputed, skipped or refused."""
    refused = s.tensors_seen - s.tensors_compressed - s.tensors_deduplicated - s.tensors_recomputed
    assert refused - sum(s.tensors_skipped.values()) == sum(s.fallbacks.values())
    if s.tensors_compressed:
        assert s.dense_bytes > 0 and s.stored_bytes > 0
        assert 0.0 <= s.zero_fraction <= 1.0


# --------------------------------------------------------------------------------------------
# (a)-(e): models


def test_relu_mlp_exact():
    model, x = mlp(), mlp_input()
    stats = check_exact(model, x)
    for s in stats:
        check_consistent(s)
        assert s.tensors_compressed == 2  # one per ReLU
        assert s.tensors_deduplicated == 2  # the next Linear saves the same tensor
        assert s.fallbacks == {}
        assert 1.5 < s.ratio < 2.5  # about half zeros in fp32
    assert stats[1].step == stats[0].step + 1


def test_transformer_relu_squared_exact():
    model, x = transformer(), sequence_input()
    stats = check_exact(model, x)
    for s in stats:
        check_consistent(s)
        # All three ways of writing relu(x)^2: the ReLU stored once, its square recomputed.
        assert s.tensors_compressed == 3
        assert s.tensors_recomputed == 3
        assert s.tensors_deduplicated >= 3
        assert s.fallbacks == {}


@pytest.mark.parametrize("variant", [0, 1, 2])
def test_each_relu_squared_spelling(variant):
    torch.manual_seed(0)
    model = nn.Sequential(Block(32, variant, nn.LayerNorm))
    x = sequence_input()
    (s, _) = check_exact(model, x)
    assert s.tensors_compressed == 1 and s.tensors_recomputed == 1, str(s)


def _count_fused_decodes(monkeypatch, corrupt: bool = False) -> list[bool]:
    """Record, for every decode the hooks run, whether it also wrote the square; with
    ``corrupt``, flip one bit of every square the codec writes."""
    calls = []
    decode = torch_codec.decode

    def recording_decode(fixed, stream, base, out, spec, geometry, sign_pack, square=None, square_grad=None):
        decode(fixed, stream, base, out, spec, geometry, sign_pack, square, square_grad)
        calls.append(square is not None)
        if corrupt and square is not None:
            square.view(-1).view(torch.int32 if square.dtype == torch.float32 else torch.int16)[0] ^= 1

    monkeypatch.setattr(torch_codec, "decode", recording_decode)
    return calls


def test_square_decodes_with_its_relu(monkeypatch):
    # Each block's ReLU output and its square come from one decode, three per backward,
    # after one check of the codec's square against pow(x, 2) on a probe of float32 patterns.
    calls = _count_fused_decodes(monkeypatch)
    model, x = transformer(), sequence_input()
    check_exact(model, x, steps=2)
    assert calls == [True] * 7


def test_a_fused_square_that_differs_is_never_used(monkeypatch):
    calls = _count_fused_decodes(monkeypatch, corrupt=True)
    model, x = transformer(), sequence_input()
    check_exact(model, x, steps=2)  # exact: the fused square failed its check on the probe
    assert calls == [True] + [False] * 6  # the square comes from pow(x, 2) on the restored ReLU


@pytest.mark.parametrize("spelling", ["mul", "pow", "square"])
def test_recomputed_square_keeps_nan_payloads(spelling):
    """A square is recomputed with the op the forward used: float16 NaNs squared by
    ``x * x`` and by ``pow(x, 2)`` differ on the CPU (0xfe00 came back as 0xffff)."""
    ops = {"mul": lambda h: h * h, "pow": lambda h: h**2, "square": torch.square}
    bits = torch.randint(-(1 << 15), 1 << 15, (64, 256), generator=torch.Generator().manual_seed(0), dtype=torch.int16)
    bits[::3, ::5] = torch.tensor(0xFE00 - (1 << 16), dtype=torch.int16)  # a negative quiet NaN
    bits[1::7, ::3] = 0x7D01  # a positive signalling NaN with a payload
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).half().requires_grad_()

    def step(ctx):
        x = bits.view(torch.float16).clone().requires_grad_()
        w.grad = None
        with ctx:
            loss = (ops[spelling](torch.relu(x)) * w).sum()
        loss.backward()
        return [w.grad.clone(), x.grad.clone()]

    expected = step(contextlib.nullcontext())
    for _ in range(2):
        assert_same_grads(step(bitsparse.compressing(**OPTIONS)), expected)
        s = bitsparse.stats()
        assert (s.tensors_compressed, s.tensors_recomputed) == (1, 1), str(s)


def test_transformer_without_recomputed_squares_exact():
    model, x = transformer(), sequence_input()
    for s in check_exact(model, x, recompute_squares=False):
        check_consistent(s)
        assert s.tensors_recomputed == 0
        assert s.tensors_compressed == 6  # each ReLU and each square stored




def test_relu_of_a_transposed_tensor_exact():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))

    def step(ctx):
        x.grad = None
        with ctx:
            y = torch.relu(x.t())  # keeps the transposed layout: strides (1, 128)
        assert not y.is_contiguous()
        (y * w).sum().backward()
        return x.grad.clone()

    expected = step(contextlib.nullcontext())
    got = step(bitsparse.compressing(**OPTIONS))
    assert bitsparse.stats().tensors_compressed == 1
    assert_same_grads([got], [expected])


def test_channels_last_convnet_exact():
    model = convnet().to(memory_format=torch.channels_last)
    x = image_input().detach().to(memory_format=torch.channels_last).requires_grad_()
    for s in check_exact(model, x):
        assert s.tensors_compressed >= 2


def test_channels_last_fallback_exact():
    """Kept dense (no room even for the masks), a channels-last tensor comes back with its
    strides: convolution backward would round differently on another layout."""
    model = convnet().to(memory_format=torch.channels_last)
    x = image_input().detach().to(memory_format=torch.channels_last).requires_grad_()
    (s,) = check_exact(model, x, steps=1, capacity=4096)
    assert s.fallbacks.get("arena_full", 0) >= 1


def test_kept_dense_tensor_is_its_own_storage_and_geometry():
    t = torch.randn(4, 6, 8).permute(2, 0, 1)[1:]  # a non-contiguous view at an offset
    handle = handles.StoredTensor(t, handles.Site("test", t, get_codec("torch", t.device), False, TileGeometry()))
    handle.confirm(False)
    restored = handle.tensor()
    assert restored.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert (restored.shape, restored.stride(), restored.storage_offset()) == (t.shape, t.stride(), t.storage_offset())
    assert_bitwise_equal(restored, t)


class ReLUSlices(nn.Module):
    """A ReLU output saved only as a row slice, at an offset in its storage (``clamp`` saves
    its input, not its output): a ReGLU-like product of it that a later op saves (recomputed
    at unpack from the slice), and a narrower slice of it saved again (found stored: a view
    of the first)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = nn.Linear(32, 128)
        self.v, self.w = nn.Parameter(torch.randn(128, generator=g)), nn.Parameter(torch.randn(128, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        r = h.clamp(min=0)[1:]
        glu = r * h[1:]
        return (glu * self.v)[2:] + r[2:] * self.w


@pytest.mark.parametrize("capacity", ["auto", 4096, ARENA], ids=["first-step-measures", "arena-full", "stored"])
def test_slices_of_a_relu_output_restore_their_own_rows(capacity):
    """Views of a tensor kept dense (a first step only measures; a full arena) read the rows
    they were saved with, as views of a decoded one do: gradients equal plain autograd's."""
    model, x = ReLUSlices(), mlp_input()
    first, second = check_exact(model, x, capacity=capacity)
    for stats in (first, second):
        assert stats.tensors_recomputed == 1 and stats.tensors_deduplicated == 1
    compressed = (first.tensors_compressed, second.tensors_compressed)
    assert compressed == ((1, 1) if capacity == ARENA else (0, 1))  # the arena grows for the second


def test_select_all_on_transformer():
    without_traceback(check_exact, transformer(), sequence_input(), select="all")


def test_convnet_exact():
    model, x = convnet(), image_input()
    for s in check_exact(model, x):
        check_consistent(s)
        assert s.tensors_compressed == 2  # the two in-place ReLUs
        assert s.tensors_deduplicated >= 1  # MaxPool2d saves the first ReLU's output
        assert s.fallbacks == {}


@pytest.mark.parametrize("use_mark", [True, False])
def test_custom_function_with_mark(use_mark):
    model, x = CustomMLP(use_mark), mlp_input()
    for s in check_exact(model, x):
        check_consistent(s)
        if use_mark:
            assert s.tensors_compressed == 1
            assert s.tensors_deduplicated == 1  # fc2 saves the marked output again
        else:
            # torch.where is not a ReLU-family op: nothing is recognised without mark().
            assert s.tensors_compressed == 0
            assert s.tensors_skipped.get("not_relu_family", 0) >= 1


def test_mark_returns_its_argument():
    t = torch.ones(3)
    assert bitsparse.mark(t) is t
    with bitsparse.compressing():
        assert bitsparse.mark(t) is t


def test_transformer_bf16_autocast_exact():
    model, x = transformer(), sequence_input()
    for s in check_exact(model, x, autocast=True):
        check_consistent(s)
        assert s.tensors_compressed == 3
        assert s.dense_bytes == 3 * 4 * 16 * 128 * 2  # bf16 ReLU outputs
        assert s.fallbacks == {}


def test_bf16_parameters_exact():
    model, x = mlp().bfloat16(), mlp_input().detach().bfloat16().requires_grad_()
    for s in check_exact(model, x, sign_pack=True):
        assert s.tensors_compressed == 2


# --------------------------------------------------------------------------------------------
# (f)-(i): ways of running backward


def test_autograd_grad_exact():
    model, x = mlp(), mlp_input()
    inputs = [*model.parameters(), x]
    expected = torch.autograd.grad(loss_of(model(x)), inputs)
    for _ in range(2):
        with bitsparse.compressing(**OPTIONS):
            out = model(x)
        got = torch.autograd.grad(loss_of(out), inputs)
        assert bitsparse.stats().tensors_compressed == 2
        del out
        assert_same_grads(list(got), list(expected))


@pytest.mark.parametrize("grad_inside", [False, True], ids=["grad_outside", "grad_inside"])
def test_double_backward_gradient_penalty(grad_inside):
    model, x = mlp(), mlp_input()

    def step(ctx):
        zero_grads(model, x)
        with ctx:
            out = model(x)
            if grad_inside:
                (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        if not grad_inside:
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (loss_of(out) + g.square().sum()).backward()
        return grads(model, x)

    expected = step(contextlib.nullcontext())
    for _ in range(2):
        got = step(bitsparse.compressing(**OPTIONS))
        assert bitsparse.stats().tensors_compressed >= 2
        assert_same_grads(got, expected)


def test_a_gradient_penalty_inside_compressing_is_one_step():
    """``autograd.grad(..., create_graph=True)``, then more forward (a one-sided penalty on
    the input gradient's norm, as WGAN-GP's), then the backward of it all, inside one block:
    one step, whose arena takes every tensor, the forward's and the penalty's."""
    model, x = mlp(), mlp_input()

    def step(ctx):
        zero_grads(model, x)
        with ctx:
            out = model(x)
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            penalty = F.relu(g.norm(dim=1) - 1).square().mean()
        (loss_of(out) + penalty).backward()
        return grads(model, x)

    expected = step(contextlib.nullcontext())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning that a graph was kept without its backward
        for i in range(3):
            got = step(bitsparse.compressing(min_numel=MIN_NUMEL))
            s = bitsparse.stats()
            assert s.step == i + 1, str(s)
            if i == 0:  # a first step only measures: every candidate kept dense
                assert s.tensors_compressed == 0 and s.fallbacks["arena_full"] >= 3, str(s)
            else:
                assert s.tensors_compressed >= 3 and s.fallbacks == {}, str(s)
            assert_same_grads(got, expected)


def test_retain_graph_two_backwards():
    model, x = mlp(), mlp_input()

    def step(ctx):
        zero_grads(model, x)
        with ctx:
            out = model(x)
        loss = loss_of(out)
        loss.backward(retain_graph=True)
        first = grads(model, x)
        loss.backward()
        return first, grads(model, x)

    expected_first, expected_second = step(contextlib.nullcontext())
    for _ in range(2):
        first, second = step(bitsparse.compressing(**OPTIONS))
        assert bitsparse.stats().tensors_compressed == 2
        assert_same_grads(first, expected_first)
        assert_same_grads(second, expected_second)


def test_gradient_accumulation():
    """Two forwards (each in its own compressing() block), then two backwards."""
    model, x1, x2 = mlp(), mlp_input(1), mlp_input(2)
    zero_grads(model, x1, x2)
    loss_of(model(x1)).backward()
    loss_of(model(x2)).backward()
    expected = grads(model, x1, x2)
    for _ in range(2):
        zero_grads(model, x1, x2)
        with bitsparse.compressing(**OPTIONS):
            out1 = model(x1)
        with bitsparse.compressing(**OPTIONS):
            out2 = model(x2)
        s = bitsparse.stats()
        assert s.tensors_compressed == 4  # both forwards in the same step
        assert alive() == 4
        loss_of(out1).backward()
        del out1
        gc.collect()
        assert alive() == 2
        loss_of(out2).backward()
        del out2
        assert_same_grads(grads(model, x1, x2), expected)


def test_interleaved_steps_reuse_the_arena():
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    steps, reserved = [], []
    for _ in range(4):
        got = train_step(model, x, bitsparse.compressing(**OPTIONS))
        assert_same_grads(got, expected)
        s = bitsparse.stats()
        steps.append(s.step)
        reserved.append(s.arena_reserved)
        assert alive() == 0 and s.tensors_compressed == 2 and s.fallbacks == {}
    assert steps == list(range(steps[0], steps[0] + 4))
    # Fitted after the first step, then the same arena: nothing more is reserved.
    assert reserved[1] == reserved[2] == reserved[3] < reserved[0]


PIPELINE_HIDDEN = 512


def pipeline_stage(zeros: float):
    """A ReLU^2 MLP stack (one ReLU output of 256 rows x ``PIPELINE_HIDDEN`` float32 saved
    per layer) whose pre-activations are ``zeros`` zeros, and its 8 microbatches."""
    from bitsparse.bench.models import MLPStack, shift_to_sparsity

    torch.manual_seed(0)
    model = MLPStack(dim=128, hidden=PIPELINE_HIDDEN, layers=3)
    inputs = [torch.randn(256, 128) for _ in range(8)]
    shift_to_sparsity(model, lambda: model(inputs[0]), zeros)
    return model, inputs


def run_pipeline(model, inputs, schedule, options: dict | None) -> tuple[list[torch.Tensor], float]:
    """One iteration of ``schedule``, each forward under ``compressing(**options)`` (dense
    where ``options`` is None): the gradients, and with BitSparse, the most that the ReLU
    outputs took (the arena, and those kept dense) at the end of a forward, over the most they
    take dense (the layers' ReLU outputs are the only tensors it stores, all of one size)."""
    model.zero_grad(set_to_none=True)
    relu_output_bytes = inputs[0].shape[0] * PIPELINE_HIDDEN * inputs[0].element_size()
    kept_dense, fallbacks, in_flight = {}, PerForward(lambda stats: sum(stats.fallbacks.values())), set()
    most = most_dense = 0

    def account(op: str, i: int) -> None:
        nonlocal most, most_dense
        if op == "B":
            in_flight.discard(i)
            kept_dense.pop(i, None)
            return
        in_flight.add(i)
        if options is not None:
            stats = bitsparse.stats()
            kept_dense[i] = fallbacks.added(stats)
            held = stats.arena_reserved + relu_output_bytes * sum(kept_dense.values())
            most = max(most, held)
            most_dense = max(most_dense, relu_output_bytes * len(model.layers) * len(in_flight))

    context = contextlib.nullcontext if options is None else lambda: bitsparse.compressing(**options)
    run_iteration(model, inputs, schedule, context, account)
    grads = [p.grad.clone() for p in model.parameters()]
    return grads, 0.0 if options is None else most / most_dense


@pytest.mark.parametrize("in_flight", [1, 2, 3])
@pytest.mark.parametrize("zeros", [0.5, 0.9])
def test_a_pipeline_schedule_keeps_its_gradients_and_holds_no_more_than_dense(zeros, in_flight):
    """One microbatch in flight is plain training; with more, forwards and backwards
    interleave, and each step is served by an arena of its own, which is free again when its
    microbatch's backward has run. No iteration holds more than it would without BitSparse,
    the first included, and once the arenas are planned, the stage holds less."""
    model, inputs = pipeline_stage(zeros)
    schedule = one_f_one_b(len(inputs), in_flight)
    expected, _ = run_pipeline(model, inputs, schedule, None)
    ratios = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            got, ratio = run_pipeline(model, inputs, schedule, {})
            assert_same_grads(got, expected)
            ratios.append(ratio)
    assert max(ratios) <= 1 and ratios[-1] < (0.3 if zeros == 0.9 else 0.9), ratios
    assert alive() == 0


def test_steps_of_batches_far_apart_in_size_hold_no_more_than_dense_at_any_step():
    """Batches of 16 and 256 rows in turn: the arena, bounded by the small steps' size, can
    take none of a large step's tensors, and lets its buffer go for that step. (Begun with a
    large batch, the first small step would hold an arena planned for the large one: see
    docs/design.md, "Steps unlike the recent ones".)"""
    model = mlp()
    batches = [mlp_input(seed=i, batch=rows) for i, rows in enumerate([16, 256] * 4)]
    ratios = []
    for x in batches:
        expected = train_step(model, x, contextlib.nullcontext())
        zero_grads(model, x)
        with bitsparse.compressing(min_numel=MIN_NUMEL):
            out = model(x)
        s = bitsparse.stats()
        relu_output_bytes = x.shape[0] * 256 * 4
        kept = s.tensors_seen - s.tensors_compressed - s.tensors_deduplicated - sum(s.tensors_skipped.values())
        ratios.append((s.arena_reserved + kept * relu_output_bytes) / (2 * relu_output_bytes))
        loss_of(out).backward()
        assert_same_grads(grads(model, x), expected)
    assert max(ratios) <= 1 and max(ratios[2::2]) < 1, ratios  # the small steps store
    assert alive() == 0


def test_a_tensor_kept_dense_for_good_no_longer_counts_as_held_in_its_arenas_place():
    """The arena's excess over its leases, which bounds the arenas of overlapping steps,
    leaves out a stored tensor whose values did not fit: it keeps its dense memory anyway."""
    model, x = mlp(), mlp_input()
    with bitsparse.compressing(min_numel=MIN_NUMEL, capacity=80_000):  # one ReLU output's values fit
        out = model(x)
    s = bitsparse.stats()
    assert s.tensors_compressed == 1 and s.fallbacks == {"arena_full": 1}, str(s)
    arena = bitsparse.training._session._pools[x.device].current
    relu_output_words = x.shape[0] * 256
    assert arena.excess_words == arena.reserved_bytes // 4 - relu_output_words > 0
    loss_of(out).backward()


def test_a_graph_dropped_in_a_pipeline_ends_its_step_though_other_microbatches_are_alive():
    """Microbatch 3's graph dropped without backward, as a skipped microbatch's is: its step is
    over, and the next forward is served by the arena it freed, planned for one microbatch,
    not by the dropped step's filled one nor for two."""
    model, inputs = pipeline_stage(0.9)
    schedule = one_f_one_b(len(inputs), 2)  # ... F3 B2 F4 B3 F5 ...
    schedule.remove(("B", 3))
    schedule.insert(schedule.index(("F", 3)) + 1, ("D", 3))  # ... F3 D3 B2 F4 F5 ...
    schedule.insert(schedule.index(("D", 3)) + 1, schedule.pop(schedule.index(("F", 4))))  # ... F3 D3 F4 B2 F5 ...
    relu_outputs = inputs[0].shape[0] * PIPELINE_HIDDEN * inputs[0].element_size() * len(model.layers)

    def iteration(options):
        model.zero_grad(set_to_none=True)
        held, fallbacks, in_flight = [], PerForward(lambda stats: sum(stats.fallbacks.values())), set()

        def account(op: str, i: int) -> None:
            if op != "F":
                in_flight.discard(i)
            elif options is not None:
                in_flight.add(i)
                stats = bitsparse.stats()
                held.append((fallbacks.added(stats), stats.arena_reserved / (relu_outputs * len(in_flight))))

        context = contextlib.nullcontext if options is None else lambda: bitsparse.compressing(**options)
        run_iteration(model, inputs, schedule, context, account)
        return [p.grad.clone() for p in model.parameters()], held

    expected, _ = iteration(None)
    for _ in range(3):
        got, held = iteration({})
        assert_same_grads(got, expected)
        assert alive() == 0
    kept, ratios = zip(*held)
    assert kept == (0,) * len(inputs) and max(ratios) < 0.5, held


def test_a_step_start_cut_short_after_its_pool_switched_arenas_leaves_no_site_storing_into_the_old_one(monkeypatch):
    """Ctrl-C once a pool has chosen the new step's arena and before the sites forgot the one
    they stored into: the step's start runs again at the next save, and so does the check."""
    model, inputs = pipeline_stage(0.9)
    schedule = one_f_one_b(len(inputs), 2)
    expected, _ = run_pipeline(model, inputs, schedule, None)
    for _ in range(2):  # measured, then planned: every tensor stored from here on
        run_pipeline(model, inputs, schedule, {})
    forget, interrupts = manager.Session._forget_stale_buffers, [KeyboardInterrupt()] * 3

    def interrupted(session):
        if interrupts:
            raise interrupts.pop()
        forget(session)

    monkeypatch.setattr(manager.Session, "_forget_stale_buffers", interrupted)
    model.zero_grad(set_to_none=True)
    losses, kept, fallbacks = {}, [], PerForward(lambda stats: sum(stats.fallbacks.values()))
    for op, i in schedule:
        if op == "B":
            losses.pop(i).backward()
            continue
        while True:
            try:
                with bitsparse.compressing():
                    losses[i] = model(inputs[i])
                break
            except KeyboardInterrupt:
                pass
        kept.append(fallbacks.added(bitsparse.stats()))
    assert not interrupts and kept == [0] * len(inputs), kept
    assert_same_grads([p.grad for p in model.parameters()], expected)
    assert alive() == 0


# --------------------------------------------------------------------------------------------
# (j)-(l): exceptions, no-grad modes, checkpointing


class Boom(RuntimeError):
    pass


class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        h = self.body[1](self.body[0](x))
        h = self.body[3](self.body[2](h))
        raise Boom("midway")


def test_exception_midway_leaks_nothing():
    model, x = Exploding(), mlp_input()
    with pytest.raises(Boom, match="midway"):
        with bitsparse.compressing(**OPTIONS):
            model(x)
    gc.collect()  # the traceback's frames held the partial graph
    assert alive() == 0
    assert not hooks_installed()
    # A normal step afterwards works and is exact; its arena step ends after backward.
    stats = check_exact(model.body, x)
    assert stats[-1].tensors_compressed == 2


class _ExpMakingNodes(torch.autograd.Function):
    """Saves its output, after its forward made autograd nodes of its own."""

    @staticmethod
    def forward(ctx, h):
        with torch.enable_grad():
            (h.detach().requires_grad_() * 2).sum()
        out = h.exp()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


def sigmoid_of_a_view(h: torch.Tensor) -> torch.Tensor:
    return (h * 1)[:, 1:].sigmoid_()


def foreach_exp(h: torch.Tensor) -> torch.Tensor:
    return torch._foreach_exp([h, h * 2])[0]


def function_exp(h: torch.Tensor) -> torch.Tensor:
    return _ExpMakingNodes.apply(h)


def softmax(h: torch.Tensor) -> torch.Tensor:
    return h.softmax(-1)


@pytest.mark.parametrize("retained_backward", [False, True], ids=["no_backward", "retain_graph"])
@pytest.mark.parametrize(
    "output_saved",
    [torch.tanh, torch.sigmoid, torch.exp, softmax, sigmoid_of_a_view, foreach_exp, function_exp],
    ids=lambda f: f.__name__,
)
def test_dropped_graph_leaks_nothing(output_saved, retained_backward):
    """A graph dropped without a backward that frees it (none, or one with retain_graph)
    frees everything, also when a skipped tensor was saved by the node that made it (a
    reference cycle if the pack hook kept its history): by an op, by an op in place on a
    view, by a foreach op and by an autograd Function whose forward made nodes of its own."""
    model, x = mlp(), mlp_input()
    with bitsparse.compressing(**OPTIONS):
        out = output_saved(model(x))
        probe = weakref.ref(out)
    assert alive() > 0 and bitsparse.stats().tensors_compressed == 2
    if retained_backward:
        out.sum().backward(retain_graph=True)
    del out
    gc.collect()
    assert probe() is None
    assert alive() == 0


@pytest.mark.parametrize("stored", [False, True], ids=["kept", "compressed"])
def test_saved_tensor_modified_in_place_raises_as_autograd_does(stored):
    """Autograd stops checking saved tensors' versions while hooks are installed; unpacking
    checks them, so a tensor modified after it was saved raises instead of giving a wrong
    gradient (exp's result is kept as it is, ReLU's is compressed)."""
    x = torch.randn(64, 512, requires_grad=True)

    def forward():
        y = torch.relu(x) if stored else torch.exp(x)
        return y, (y * y).sum()

    y, loss = forward()
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        loss.backward()
    with bitsparse.compressing(**OPTIONS):
        y, loss = forward()
    assert bitsparse.stats().tensors_compressed == int(stored)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as compressed:
        loss.backward()
    assert "Hint" in str(plain.value) and "Hint" in str(compressed.value)


@pytest.mark.parametrize("stored", [False, True], ids=["held", "compressed"])
def test_saved_tensor_modified_in_place_and_dropped(stored):
    """A ReLU output saved, modified in place, then dropped (a local of a forward): autograd
    raises. Held dense (a first step only measures), its memory holds the new values, and
    unpacking raises as autograd does; compressed, it restores the values the forward used,
    whose gradients are exact (those autograd would give had the tensor not changed)."""
    x = torch.randn(64, 512, requires_grad=True)
    w = torch.randn(512, 16, requires_grad=True)

    def forward():
        h = torch.relu(x)
        y = h @ w
        h.sub_(1)
        return y

    loss = forward().sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with bitsparse.compressing(**(OPTIONS if stored else {"min_numel": MIN_NUMEL})):
        loss = forward().sum()
    s = bitsparse.stats()
    assert (s.tensors_compressed, s.fallbacks) == ((1, {}) if stored else (0, {"arena_full": 1})), str(s)
    if not stored:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        return
    loss.backward()
    expected = torch.relu(x.detach()).t() @ torch.ones(64, 16)
    assert_bitwise_equal(w.grad, expected)


@pytest.mark.parametrize("between", ["outside", "kept"])
def test_square_of_a_relu_output_changed_before_it_is_recomputed_from_what_it_squared(between):
    """A stored ReLU output changed in place under no_grad, then squared where BitSparse's
    hooks do not store it (outside ``compressing()``, or kept for its size): the square is
    not recomputed from the stored values, which are not the ones it squared."""

    def w_grad(outer, middle):
        torch.manual_seed(0)
        x = (torch.randn(64, 256) - 0.3).requires_grad_()
        w = torch.randn(256, 8, requires_grad=True)
        with outer():
            r = x.relu()
        with torch.no_grad():
            r.mul_(2)
        with middle():
            s = r.square()
        with outer():
            y = s @ w
        return torch.autograd.grad(y.sum(), w)[0]

    expected = w_grad(contextlib.nullcontext, contextlib.nullcontext)
    compressing = functools.partial(bitsparse.compressing, **OPTIONS)
    middle = contextlib.nullcontext
    if between == "kept":
        middle = functools.partial(bitsparse.compressing, min_numel=1 << 30)
    got = w_grad(compressing, middle)
    assert_bitwise_equal(got, expected)
    s = bitsparse.stats()
    assert s.tensors_recomputed == 0 and s.tensors_compressed == 2, str(s)


def test_the_unpack_hook_restores_eager_values_itself_and_routes_the_rest():
    """What the pack hook returns in eager autograd (a kept tensor with its version, a
    handle) is restored without the route that looks for a compiled graph's tracing, which
    gets everything else: a traced ``(key, size, stride)`` tuple, a value kept as it is."""
    session, routed = manager.Session(), []
    hook = session.unpack_hook(lambda packed: routed.append(packed) or "routed")
    t = torch.relu(torch.randn(4096))
    assert hook((t, t._version)) is t
    held = handles.StoredTensor(t, handles.Site("relu", t, torch_codec, False, TileGeometry()))
    assert_bitwise_equal(hook(held), t)
    assert routed == []
    traced = (torch.zeros(1), (4096,), (1,))
    assert hook(traced) == "routed" and hook(t) == "routed"
    assert routed[0] is traced and routed[1] is t


def test_parameter_modified_in_place_before_backward_raises_as_autograd_does():
    """A parameter's view (Linear saves ``weight.t()``) is kept as it is; an optimizer step
    between forward and backward must still raise rather than use the new weights."""
    lin = nn.Linear(512, 512)
    x = torch.randn(64, 512, requires_grad=True)
    with bitsparse.compressing(**OPTIONS):
        loss = lin(x).sum()
    assert bitsparse.stats().tensors_skipped.get("parameter", 0) >= 1
    with torch.no_grad():
        lin.weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_no_grad_inside_compressing_stores_nothing():
    model, x = mlp(), mlp_input()
    before = bitsparse.stats().as_dict()
    with bitsparse.compressing(**OPTIONS):
        with torch.no_grad():
            out = model(x)
    assert out.grad_fn is None
    assert bitsparse.stats().as_dict() == before
    assert alive() == 0


def test_inference_mode_inside_compressing():
    model, x = mlp(), mlp_input()
    with bitsparse.compressing(**OPTIONS):
        with torch.inference_mode():
            out = model(x)
    assert out.is_inference()
    assert alive() == 0


def test_inference_mode_without_relu_inside_compressing():
    """Ops that are not ReLU-family run fine in inference mode."""
    lin = nn.Linear(32, 32)
    with bitsparse.compressing(**OPTIONS):
        with torch.inference_mode():
            out = torch.tanh(lin(torch.randn(8, 32)))
    assert out.is_inference()


class CheckpointedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 256)
        self.block = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = checkpoint(self.block, h, use_reentrant=False)
        return self.head(h)


def test_non_reentrant_checkpoint_exact():
    model, x = CheckpointedMLP(), mlp_input()
    for s in check_exact(model, x):
        check_consistent(s)
        # The ReLU outside the region is compressed; inside, checkpointing's hooks win.
        assert s.tensors_compressed >= 1


# --------------------------------------------------------------------------------------------
# (m)-(o): options


def test_select_all_on_convnet():
    model, x = convnet(), image_input()
    stats = check_exact(model, x, steps=3, select="all")
    for s in stats:
        check_consistent(s)
        assert s.tensors_compressed >= 2  # the sparse ReLU outputs always pay
    # Dense tensors (BatchNorm inputs, ...) were tried once and then skipped by site.
    assert stats[0].tensors_compressed > stats[-1].tensors_compressed
    assert stats[-1].tensors_skipped.get("unprofitable_site", 0) > 0
    assert stats[-1].ratio > 1.1


class KeepsItsReLUOutputs(nn.Module):
    """An MLP that keeps each ReLU output it computes (features for a loss or a log, say):
    they stay alive through backward, so storing them would free none of their memory."""

    def __init__(self):
        super().__init__()
        self.mlp = mlp()
        self.kept: list[torch.Tensor] = []

    def forward(self, x):
        for layer in self.mlp:
            x = layer(x)
            if isinstance(layer, nn.ReLU):
                self.kept.append(x)
        return x


def test_a_site_whose_tensors_outlive_the_forward_is_kept_as_is():
    model = KeepsItsReLUOutputs()
    stats = check_exact(model, mlp_input(), steps=3)
    # Stored once (the arena is explicit); alive when backward began, so never again.
    assert [s.tensors_compressed for s in stats] == [2, 0, 0]
    # Each of the two sites: the ReLU's save of its output and the next Linear's of its input.
    assert stats[-1].tensors_skipped["unprofitable_site"] == 4
    model.kept.clear()


def test_tensors_passed_between_blocks_are_stored_every_step():
    """A tensor alive past the block that stored it, but not past the forward, pays."""
    model, x = mlp(), mlp_input()
    first, second = model[:2], model[2:]
    for _ in range(3):
        with bitsparse.compressing(**OPTIONS):
            h = first(x)
        with bitsparse.compressing(**OPTIONS):
            out = second(h)
        del h
        out.sum().backward()
        assert bitsparse.stats().tensors_compressed == 2


def test_sign_pack_exact():
    model, x = mlp(), mlp_input()
    plain = check_exact(model, x)[-1]
    _settle()
    packed = check_exact(model, x, sign_pack=True)[-1]
    assert packed.tensors_compressed == plain.tensors_compressed == 2
    assert packed.dense_bytes == plain.dense_bytes
    assert packed.stored_bytes < plain.stored_bytes  # 31-bit values


def test_sign_pack_on_convnet_and_transformer():
    check_exact(convnet(), image_input(), sign_pack=True)
    check_exact(transformer(), sequence_input(), sign_pack=True, autocast=True)


def test_tiny_arena_falls_back_exactly():
    model, x = mlp(), mlp_input()
    stats = check_exact(model, x, steps=3, capacity=4096)
    assert stats[0].fallbacks.get("arena_full", 0) > 0
    for s in stats:
        check_consistent(s)
    # The arena grows to fit: by the last step nothing falls back.
    assert stats[-1].fallbacks == {}
    assert stats[-1].tensors_compressed == 2


def test_tiny_value_region_falls_back_exactly():
    """Fixed words fit, values overflow: the compressed tensor keeps its dense copy."""
    model, x = mlp(hidden=64), mlp_input()  # 4096-element ReLU outputs, 2048 value words each
    stats = check_exact(model, x, steps=1, capacity=8192)  # 2048 fixed bytes, 1535 value words
    s = stats[0]
    check_consistent(s)
    assert s.tensors_compressed == 0 and s.fallbacks == {"arena_full": 2}
    assert s.stored_bytes == s.dense_bytes  # a fallback counts dense


def pack_outcome(route: str, t: torch.Tensor, select: str, marked: bool) -> tuple:
    """What a fresh session makes of saving ``t`` through ``route``, the pack hook ("screen")
    or ``Session.pack``: the skip reason (None: handed to the store), whether ``t`` itself is
    kept (not a detached alias) and its version."""
    session, options = manager.Session(), Options(min_numel=MIN_NUMEL, select=select)
    if marked:
        session.marks.mark(t)
    save = session.pack_hook(options, other=None) if route == "screen" else functools.partial(session.pack, options)
    packed = save(t)
    (reason,) = session.stats().tensors_skipped or [None]
    if reason is None:
        return None, None, None
    kept, version = packed
    return reason, kept is t, version


@pytest.mark.parametrize("select", ["relu", "all"])
def test_the_first_screen_decides_as_pack_does(select):
    """The pack hook screens the commonest tensors itself and hands the rest to ``pack``: for
    each kind of saved tensor, both keep it for the same reason, or both store it."""
    torch.manual_seed(0)
    weight, x = nn.Parameter(torch.randn(64, 64)), torch.randn(64, 64, requires_grad=True)
    tanh = torch.tanh(x)
    cases = {  # name: (tensor, marked, reason under select="relu")
        "weight": (weight, False, "parameter"),
        "weight.t()": (weight.t(), False, "parameter"),
        "frozen weight": (nn.Parameter(torch.randn(64, 64), requires_grad=False), False, "not_relu_family"),
        "input": (x, False, "parameter"),
        "constant": (torch.randn(64, 64), False, "not_relu_family"),
        "small": (nn.Parameter(torch.randn(8)), False, "small"),
        "tanh": (tanh, False, "not_relu_family"),
        "tanh view": (tanh[:32], False, "not_relu_family"),
        "tanh cast": (tanh.bfloat16(), False, "not_relu_family"),
        "relu": (torch.relu(x), False, None),
        "relu cast": (torch.relu(x).bfloat16(), False, None),
        "relu float64": (torch.relu(x.double()), False, "dtype"),
        "relu broadcast": (torch.relu(x)[:, :1].expand(64, 64), False, "overlapping_or_gapped"),
        "marked": (torch.relu(torch.randn(64, 64)), True, None),
    }
    for name, (t, marked, reason) in cases.items():
        screened = pack_outcome("screen", t, select, marked)
        assert screened == pack_outcome("pack", t, select, marked), name
        if select == "relu":
            assert screened[0] == reason, name
    # Only what has no history is kept as it is: the rest is detached (see Session.pack).
    assert pack_outcome("screen", weight.t(), "relu", False)[1:] == (True, weight._version)
    assert pack_outcome("screen", tanh, "relu", False)[1] is False


def test_a_refused_first_tensor_does_not_end_the_step():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(64, 256), nn.Linear(256, 8)
    x = torch.randn(32, 64)  # ReLU output: 8192 elements, 2064 fixed bytes > the 1024 there are
    with bitsparse.compressing(capacity=4096, min_numel=MIN_NUMEL):
        y = lin2(torch.relu(lin1(x)))
    s = bitsparse.stats()
    del y
    # Saved: x (not ReLU-family), the ReLU output (refused), the ReLU output again for lin2's
    # weight gradient (sharing the refused slot, not refused again), and lin2.weight.t() (a
    # parameter).
    assert s.tensors_seen == 4
    assert s.tensors_skipped == {"not_relu_family": 1, "parameter": 1}
    assert s.fallbacks == {"arena_full": 1} and s.tensors_deduplicated == 1
    assert s.arena_reserved < 2 * 4096  # resizing waits for the step's end


# --------------------------------------------------------------------------------------------
# Statistics against the format


def relu_mlp_layers(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(64, 300), nn.Linear(300, 8)


def stats_input():
    return torch.randn(50, 64, generator=torch.Generator().manual_seed(7))  # h: 15000 elements


def expected_nbytes(h: torch.Tensor, sign_pack: bool = False) -> tuple[int, int]:
    """Exact compressed size of ``h`` from its bit patterns, and its number of nonzeros."""
    spec = dtype_spec(h.dtype)
    tile = TileGeometry().tile_size
    bits = h.detach().reshape(-1).view(spec.bits_dtype)
    counts, packed = [], []
    for start in range(0, bits.numel(), tile):
        chunk = bits[start : start + tile]
        nonzero = chunk != 0
        counts.append(int(nonzero.sum()))
        packed.append(sign_pack and not bool((nonzero & (chunk < 0)).any()))
    return compressed_nbytes(bits.numel(), spec, counts, packed), sum(counts)


@pytest.mark.parametrize("sign_pack", [False, True])
def test_stats_match_the_format(sign_pack):
    lin1, lin2 = relu_mlp_layers()
    x = stats_input()
    h_expected = torch.relu(lin1(x)).detach()
    assert h_expected.numel() == 15000
    nbytes, nnz = expected_nbytes(h_expected, sign_pack)
    with bitsparse.compressing(**OPTIONS, sign_pack=sign_pack):
        y = lin2(torch.relu(lin1(x)))
    y.sum().backward()
    s = bitsparse.stats()
    assert s.tensors_compressed == 1
    assert s.tensors_deduplicated == 1  # lin2 saves the ReLU output for its weight gradient
    assert s.tensors_recomputed == 0
    assert s.tensors_skipped == {"not_relu_family": 1, "parameter": 1}  # x, lin2.weight.t()
    assert s.tensors_seen == 4
    assert s.fallbacks == {}
    assert s.dense_bytes == 15000 * 4
    assert s.stored_bytes == nbytes
    assert s.zero_fraction == pytest.approx(1 - nnz / 15000, abs=1e-12)
    assert 0.3 < s.zero_fraction < 0.7
    assert s.ratio == pytest.approx(s.dense_bytes / s.stored_bytes)
    assert s.arena_reserved > 0 and 0 < s.arena_peak <= s.arena_reserved
    assert s.arena_peak == s.stored_bytes  # the one stored tensor is all the arena holds
    assert s.window_waits == 0


def test_stats_of_a_relu_squared_block():
    lin1, lin2 = relu_mlp_layers()
    x = stats_input()
    h_expected = torch.relu(lin1(x)).detach()
    nbytes, nnz = expected_nbytes(h_expected)
    with bitsparse.compressing(**OPTIONS):
        y = lin2(F.relu(lin1(x)).square())
    y.sum().backward()
    s = bitsparse.stats()
    # relu result: compressed; square's input (the same tensor): shared; lin2's input: recomputed.
    assert (s.tensors_compressed, s.tensors_deduplicated, s.tensors_recomputed) == (1, 1, 1)
    assert s.tensors_skipped == {"not_relu_family": 1, "parameter": 1}
    assert s.tensors_seen == 5
    assert s.dense_bytes == 15000 * 4  # only the ReLU output is stored
    assert s.stored_bytes == nbytes
    assert s.zero_fraction == pytest.approx(1 - nnz / 15000, abs=1e-12)


def test_stats_dict_and_str():
    lin1, lin2 = relu_mlp_layers()
    x = stats_input()
    with bitsparse.compressing(**OPTIONS):
        y = lin2(F.relu(lin1(x)).square())
    y.sum().backward()
    s = bitsparse.stats()
    d = s.as_dict()
    assert set(d) == {
        "step", "tensors_seen", "tensors_compressed", "tensors_deduplicated", "tensors_recomputed",
        "tensors_skipped", "fallbacks", "dense_bytes", "stored_bytes", "zero_fraction",
        "arena_reserved", "arena_peak", "spill_reserved", "spilled_bytes", "window_waits", "tensors_alive",
        "ratio",
    }
    assert d["ratio"] == s.ratio
    assert d["tensors_skipped"] == {"not_relu_family": 1, "parameter": 1}
    text = str(s)
    assert f"step {s.step}:" in text
    assert "1/5 saved tensors compressed" in text
    assert "+1 shared, 1 recomputed" in text
    assert f"({s.ratio:.2f}x, {100 * s.zero_fraction:.1f}% zeros)" in text
    assert "skipped: not_relu_family 1, parameter 1" in text
    assert "fallbacks: none" in text




def test_identical_steps_have_identical_stats():
    lin1, lin2 = relu_mlp_layers()
    x = stats_input()
    stats = []
    for _ in range(3):
        with bitsparse.compressing(**OPTIONS):
            y = lin2(torch.relu(lin1(x)))  # x (not ReLU-family) is saved before the ReLU output
        y.sum().backward()
        del y
        stats.append(bitsparse.stats().as_dict())
    for d in stats:
        d.pop("step")
    assert stats[2] == stats[1], (stats[1], stats[2])
    # After the first step the arena is fitted to what it needed; the rest is the same.
    arena_fields = ("arena_reserved", "arena_peak")
    assert {k: v for k, v in stats[1].items() if k not in arena_fields} == {
        k: v for k, v in stats[0].items() if k not in arena_fields
    }
    assert stats[0]["tensors_seen"] == 4


def test_a_step_that_stores_nothing_has_its_own_stats():
    lin1, lin2 = relu_mlp_layers()
    x = stats_input()
    with bitsparse.compressing(**OPTIONS):
        y = lin2(torch.relu(lin1(x)))
    y.sum().backward()
    del y
    first = bitsparse.stats()
    first_dict = first.as_dict()
    assert first.tensors_compressed == 1
    with bitsparse.compressing(min_numel=1 << 30):  # everything is too small now
        y = lin2(torch.relu(lin1(x)))
    y.sum().backward()
    del y
    s = bitsparse.stats()
    assert first.as_dict() == first_dict, "the finished step's stats changed afterwards"
    assert s.tensors_compressed == 0 and s.dense_bytes == 0
    assert s.tensors_skipped == {"small": 4}


def test_stats_ratio_without_storage():
    assert Stats().ratio == 1.0
    assert "fallbacks: none" in str(Stats())


def test_stats_after_backward_describe_the_finished_step():
    model, x = mlp(), mlp_input()
    with bitsparse.compressing(**OPTIONS):
        out = model(x)
    during = bitsparse.stats().as_dict()
    assert during.pop("tensors_alive") == 2  # a field of the moment, not of the step
    loss_of(out).backward()
    del out
    after = bitsparse.stats().as_dict()
    assert after.pop("tensors_alive") == 0
    assert after == during
    # A plain forward outside compressing() does not touch them.
    loss_of(model(x)).backward()
    assert {k: v for k, v in bitsparse.stats().as_dict().items() if k != "tensors_alive"} == after


def test_dense_storage_is_freed_at_pack():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(64, 1024), nn.Linear(1024, 8)
    x = torch.randn(128, 64, requires_grad=True)  # h: 131072 elements, 512 KiB
    params = [*lin1.parameters(), *lin2.parameters(), x]

    expected = torch.autograd.grad(loss_of(lin2(torch.relu(lin1(x)))), params)
    with bitsparse.compressing(**OPTIONS):
        h = torch.relu(lin1(x))
        storage = weakref.ref(h.untyped_storage())
        y = lin2(h)
        del h
    gc.collect()
    assert storage() is None, "the dense ReLU output is still alive"
    assert bitsparse.stats().tensors_compressed == 1
    got = torch.autograd.grad(loss_of(y), params)
    assert_same_grads(list(got), list(expected))


def test_dense_storage_kept_without_compressing():
    """The control for the test above: autograd itself keeps the ReLU output."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(64, 1024), nn.Linear(1024, 8)
    x = torch.randn(128, 64, requires_grad=True)
    h = torch.relu(lin1(x))
    storage = weakref.ref(h.untyped_storage())
    y = lin2(h)
    del h
    gc.collect()
    assert storage() is not None
    del y


# --------------------------------------------------------------------------------------------
# Reports through slots: the arenas' CUDA path, on the CPU (the torch codec writes the slots)


@pytest.fixture
def reporting_arenas(monkeypatch):
    monkeypatch.setattr(pool, "Arena", functools.partial(Arena, asynchronous=True))


def test_reported_appends_are_exact(reporting_arenas):
    for s in check_exact(transformer(), sequence_input(), steps=2, autocast=True):
        check_consistent(s)
        assert s.tensors_compressed > 0 and s.window_waits == 0  # everything was sure to fit
    check_exact(convnet(), image_input(), steps=2)
    # A fresh session: the models before would bound the arena (docs/design.md, "Growth policy").
    bitsparse.reset()
    stats = check_exact(mlp(), mlp_input(), steps=3, capacity=4096)  # too small at first, then grown
    assert stats[0].fallbacks.get("arena_full", 0) > 0 and stats[-1].fallbacks == {}


def test_a_step_the_bound_holds_back_keeps_dense_what_the_device_part_cannot_hold(reporting_arenas):
    """Batches of two sizes in turn, whose larger one's ReLU outputs (about half zeros) take
    more stored than the smaller one's take dense, the bound of the arena's device part
    (docs/design.md, "Growth policy"): the larger steps store the tensors whose values fit on
    the device and keep the others dense, rather than send values to the spill region at every
    such step. Gradients stay exact all along."""
    bitsparse.reset()
    model = mlp()
    inputs = [mlp_input(batch=64), mlp_input(batch=128)]
    expected = [train_step(model, x, contextlib.nullcontext()) for x in inputs]
    for step in range(DEMAND_STEPS + 2):
        got = train_step(model, inputs[step % 2], bitsparse.compressing(min_numel=MIN_NUMEL))
        assert_same_grads(got, expected[step % 2])
        s = bitsparse.stats()
        check_consistent(s)
        if step >= 3 and step % 2:  # a larger step planned with a smaller one's bound
            assert s.tensors_compressed > 0 and s.fallbacks.get("arena_full", 0) > 0, str(s)
            assert s.spilled_bytes == 0, str(s)
    assert alive() == 0


def relu_of_linear(capacity: int):
    """A ReLU output of 131072 float32 elements (about half zeros) stored under
    ``compressing(capacity=capacity)``: its storage, weakly, and the graph's output."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(64, 1024), nn.Linear(1024, 8)
    x = torch.randn(128, 64, requires_grad=True)
    with bitsparse.compressing(min_numel=MIN_NUMEL, capacity=capacity):
        h = torch.relu(lin1(x))
        storage = weakref.ref(h.untyped_storage())
        y = lin2(h)  # saves h again: found stored, and the first report is read
        del h
    return storage, y


def test_a_tensor_sure_to_fit_is_not_held_until_its_report(reporting_arenas, monkeypatch):
    monkeypatch.setattr(Arena, "poll", lambda self, awaited_only=False: None)  # no report is read
    storage, y = relu_of_linear(capacity=ARENA)  # 196607 value words: sure of 131072
    gc.collect()
    assert storage() is None, "the dense ReLU output is still alive"
    del y


def test_a_tensor_not_sure_to_fit_is_held_until_its_report(reporting_arenas, monkeypatch):
    # 89999 value words: not sure of 131072, room for the about 65536 it takes.
    poll = Arena.poll
    monkeypatch.setattr(Arena, "poll", lambda self, awaited_only=False: None)
    storage, y = relu_of_linear(capacity=480_000)
    gc.collect()
    assert storage() is not None
    monkeypatch.setattr(Arena, "poll", poll)
    s = bitsparse.stats()  # reads the report: it fits
    assert s.tensors_compressed == 1 and s.fallbacks == {}
    gc.collect()
    assert storage() is None
    del y


def test_the_forward_delivers_no_report_of_a_tensor_sure_to_fit(reporting_arenas, monkeypatch):
    # Every store is sure (the arena has room for both ReLU outputs at their dense size): the
    # forward spends no time on their reports, which the backward's unpacks take.
    model, x = mlp(), mlp_input()
    check_exact(model, x, steps=1)
    deliver, delivered = Arena._deliver, []

    def recording_deliver(arena, wait):
        delivered.append(wait)
        deliver(arena, wait)

    monkeypatch.setattr(Arena, "_deliver", recording_deliver)
    with bitsparse.compressing(**OPTIONS):
        loss = model(x).square().sum()
    assert delivered == [] and bitsparse.stats().tensors_compressed == 2  # stats() drains: not before
    del loss  # the graph dropped: the next forward is a new step
    delivered.clear()
    with bitsparse.compressing(**OPTIONS):
        loss = model(x).square().sum()
    assert delivered == []
    loss.backward()
    assert delivered == [False, False]  # arrived (at once on the CPU): taken without a wait
    s = bitsparse.stats()
    assert s.fallbacks == {} and s.tensors_compressed == 2 and s.stored_bytes < s.dense_bytes


class LaggingDevice:
    """Plays a GPU that runs behind the host for arenas that report through slots on the CPU:
    the torch codec's report words (appends' ends) are written ``lag`` appends late, or when
    an arena waits for one (the GPU catches up)."""

    def __init__(self, monkeypatch, lag: int):
        self.lag, self.queued = lag, []
        self.waits = 0
        for name in ("encode", "measure"):
            monkeypatch.setattr(torch_codec, name, self._reporting_late(getattr(torch_codec, name)))
        wait_for = Arena._wait_for

        def caught_up(arena, slot):
            self.waits += 1
            self.run(len(self.queued))
            wait_for(arena, slot)

        monkeypatch.setattr(Arena, "_wait_for", caught_up)

    def _reporting_late(self, append):
        signature = inspect.signature(append)

        def append_late(*args, **kwargs):
            call = signature.bind(*args, **kwargs)
            report = call.arguments.pop("report", None)
            append(*call.args, **call.kwargs)
            if report is not None:
                self.queued.append((report, int(call.arguments["cursor"]) + 1))
                self.run(len(self.queued) - self.lag)

        return append_late

    def run(self, appends: int) -> None:
        for report, value in self.queued[: max(appends, 0)]:
            report.fill_(value)
        del self.queued[: max(appends, 0)]


@pytest.mark.parametrize("lag", [1, 3])
def test_reports_that_lag_behind_the_host(reporting_arenas, monkeypatch, lag):
    device = LaggingDevice(monkeypatch, lag)
    out_at_unpack = []
    unpack = handles.Handle.unpack

    def counting_unpack(handle):
        out_at_unpack.append(len(device.queued))
        return unpack(handle)

    monkeypatch.setattr(handles.Handle, "unpack", counting_unpack)
    for s in check_exact(transformer(), sequence_input(), steps=3, autocast=True):
        check_consistent(s)
        assert s.fallbacks == {} and s.tensors_compressed > 0
    assert max(out_at_unpack) == lag, "backward unpacked tensors whose reports were still out"
    # Values that can never be sure (4096-word tensors, 1535 value words): each stored tensor
    # is held, the second waits for the first, and both fall back, exactly. (A new session:
    # the transformer's steps would let the host hold more, see the next test.)
    bitsparse.reset()
    (s,) = check_exact(mlp(hidden=64), mlp_input(), steps=1, capacity=8192)
    assert s.tensors_compressed == 0 and s.fallbacks == {"arena_full": 2}
    assert s.window_waits == 1 and device.waits > 0


@pytest.mark.parametrize("window", [None, 3])
def test_held_tensors_stay_within_the_window_and_the_hold_allowance(reporting_arenas, monkeypatch, window):
    # Six ReLU outputs of 4096 float32 elements, about half zeros, with the GPU three appends
    # behind: from the second step on, the arena (1.15x the values) is sure of the first
    # three only, and the others are held until their reports come.
    LaggingDevice(monkeypatch, lag=3)
    submit = Arena.submit
    held = []

    def recording_submit(arena, slot, on_end=None):
        number = submit(arena, slot, on_end)
        held.append((arena._throttled, arena._held_words, arena._hold_allowance))
        return number

    monkeypatch.setattr(Arena, "submit", recording_submit)
    torch.manual_seed(0)
    # A Linear last: the caller keeps the output, and storing a tensor that stays alive frees
    # nothing (the step's allowance would leave it out).
    model = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(64, 64), nn.ReLU())], nn.Linear(64, 64))
    stats = check_exact(model, torch.randn(64, 64), steps=3, window=window, host_spill=False)
    assert all(s.fallbacks == {} and s.tensors_compressed == 6 for s in stats[1:])
    # Several held at once, at most the window, and beyond the first only within the step's
    # allowance (the dense size of the tensors it stores less the arena's): about 2.5 tensors.
    assert 1 < max(throttled for throttled, _, _ in held) <= (window or 6)
    assert all(words <= allowance for throttled, words, allowance in held if throttled > 1)
    assert 2 * 4096 < held[-1][2] < 3 * 4096


@pytest.mark.parametrize("host_spill", [True, False])
def test_a_spilling_arena_is_sure_of_every_tensor_when_the_gpu_lags_far_behind(
    reporting_arenas, monkeypatch, host_spill
):
    # No report arrives during a forward. Two steps size the arena for ReLU outputs about half
    # zeros; a third whose outputs are nearly all nonzero (biases raised) outruns its device part.
    device = LaggingDevice(monkeypatch, lag=100)
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(64, 64), nn.ReLU())])
    x = torch.randn(64, 64)
    for s in check_exact(model, x, steps=2, host_spill=host_spill):
        check_consistent(s)
    with torch.no_grad():
        for layer in model[::2]:
            layer.bias.fill_(4.0)
    (s,) = check_exact(model, x, steps=1, host_spill=host_spill)
    check_consistent(s)
    if host_spill:
        # Every tensor sure: none held, none waited for, none fallen back; the values past
        # the device part went to the spill region.
        assert s.tensors_compressed == 6 and s.fallbacks == {} and s.window_waits == 0
        assert s.spill_reserved > 0 and 0 < s.spilled_bytes < s.stored_bytes
        assert s.zero_fraction < 0.1
    else:
        assert s.spill_reserved == s.spilled_bytes == 0
        assert s.window_waits > 0 and s.fallbacks.get("arena_full", 0) > 0
    assert device.waits > 0  # the step's end drains the reports


def test_the_span_index_finds_live_spans_and_forgets_freed_owners():
    index, first, second = SpanIndex(), handles.Handle(), handles.Handle()
    a = torch.zeros(4096)
    owner = weakref.ref(a)
    index.add(span_of(a[:1024]), weakref.ref(first), owner)
    index.add(span_of(a[2048:]), weakref.ref(second), owner)
    assert index.find(span_of(a[100:200])) is first and index.find(span_of(a[3000:])) is second
    assert index.find(span_of(a[1000:1100])) is None  # not inside one span
    assert index.find(span_of(a[100:200].view(torch.int32))) is None  # another dtype
    assert span_of(a[2048:], 2048) == span_of(a[2048:])  # the count a caller knows, for a dense tensor
    channels_last = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert span_of(channels_last, 120) == span_of(channels_last)
    a[5:6].add_(1)
    assert index.find(span_of(a[100:200])) is None  # another version
    address = a.data_ptr()
    del a
    # The allocator hands the freed address out again, to a tensor the index never saw.
    reused = next((b for b in (torch.zeros(4096) for _ in range(100)) if b.data_ptr() == address), None)
    if reused is None:
        pytest.skip("the allocator did not reuse the address")
    assert index.find(span_of(reused[100:200])) is None and len(index) == 0
    view = reused[:10]
    index.add(span_of(view), weakref.ref(second), weakref.ref(view))
    assert index.find(span_of(reused[:5])) is second and len(index) == 1
    del view  # an entry lives as long as its owner, even where the storage outlives it
    assert index.find(span_of(reused[:5])) is None


def test_a_held_tensor_whose_values_did_not_fit_keeps_its_dense_copy():
    torch.manual_seed(0)
    t = torch.relu(torch.randn(4096))
    site = handles.Site("relu", t, torch_codec, False, TileGeometry())
    held = handles.StoredTensor(t, site)
    held.confirm(False)  # a fallback: the dense copy stays
    assert not held.is_compressed
    assert_bitwise_equal(held.tensor(), t)


# --------------------------------------------------------------------------------------------
# enable() / disable()


def test_enable_then_plain_training_compresses():
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    bitsparse.enable(**OPTIONS)
    assert bitsparse.is_enabled()
    for _ in range(2):
        got = train_step(model, x, contextlib.nullcontext())
        assert_same_grads(got, expected)
        assert bitsparse.stats().tensors_compressed == 2
    bitsparse.disable()
    assert not bitsparse.is_enabled()
    # Disabled: nothing is packed any more.
    before = bitsparse.stats().as_dict()
    assert_same_grads(train_step(model, x, contextlib.nullcontext()), expected)
    assert bitsparse.stats().as_dict() == before


def test_enable_twice_reconfigures_without_stacking():
    model, x = mlp(), mlp_input()
    bitsparse.enable(**OPTIONS)
    bitsparse.enable(min_numel=1 << 30)  # replaces the options: nothing is large enough now
    enabled_hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    torch._C._autograd._pop_saved_tensors_default_hooks()
    assert not hooks_installed(), "enable() stacked a second pair of hooks"
    torch._C._autograd._push_saved_tensors_default_hooks(*enabled_hooks)
    train_step(model, x, contextlib.nullcontext())
    s = bitsparse.stats()
    assert s.tensors_compressed == 0 and s.tensors_skipped.get("small", 0) > 0
    bitsparse.enable(**OPTIONS)
    train_step(model, x, contextlib.nullcontext())
    assert bitsparse.stats().tensors_compressed == 2
    bitsparse.disable()  # once is enough
    assert not bitsparse.is_enabled() and not hooks_installed()
    before = bitsparse.stats().as_dict()
    train_step(model, x, contextlib.nullcontext())
    assert bitsparse.stats().as_dict() == before
    bitsparse.disable()  # a no-op now


def test_compressing_inside_enable():
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    bitsparse.enable(min_numel=1 << 30)  # enabled, but compressing nothing
    got = train_step(model, x, bitsparse.compressing(**OPTIONS))
    assert_same_grads(got, expected)
    assert bitsparse.stats().tensors_compressed == 2  # the inner block's options won
    assert bitsparse.is_enabled()
    # enable()'s options apply again: nothing is stored (no live compressed tensors).
    small_before = bitsparse.stats().tensors_skipped.get("small", 0)
    zero_grads(model, x)
    out = model(x)
    assert alive() == 0
    assert bitsparse.stats().tensors_skipped.get("small", 0) > small_before
    loss_of(out).backward()
    bitsparse.enable(**OPTIONS)
    with bitsparse.compressing(min_numel=1 << 30):
        zero_grads(model, x)
        out = model(x)
    assert alive() == 0  # the inner block's options won
    loss_of(out).backward()
    del out
    zero_grads(model, x)
    out = model(x)
    assert alive() == 2  # enable()'s hooks are back
    loss_of(out).backward()
    del out
    assert bitsparse.stats().tensors_compressed == 2
    assert_same_grads(grads(model, x), expected)


@pytest.mark.parametrize("inner", [{}, {**OPTIONS, "sign_pack": True}], ids=["other_hooks", "shared_hooks"])
def test_disable_inside_compressing_raises(inner):
    bitsparse.enable(**OPTIONS)
    with bitsparse.compressing(**inner):
        with pytest.raises(RuntimeError, match="inside compressing"):
            bitsparse.disable()
        assert bitsparse.is_enabled()
    assert bitsparse.is_enabled()
    bitsparse.disable()
    assert not bitsparse.is_enabled()


def test_enable_inside_compressing_raises():
    with bitsparse.compressing():
        with pytest.raises(RuntimeError, match="compressing"):
            bitsparse.enable()
        assert not bitsparse.is_enabled()
    assert not bitsparse.is_enabled()


@pytest.mark.parametrize("inner", [{}, {**OPTIONS, "sign_pack": True}], ids=["other_hooks", "shared_hooks"])
def test_enable_inside_compressing_while_enabled_raises(inner):
    bitsparse.enable(**OPTIONS)
    with bitsparse.compressing(**inner):
        with pytest.raises(RuntimeError, match="compressing"):
            bitsparse.enable(min_numel=1)
        assert bitsparse.is_enabled()
    model, x = mlp(), mlp_input()
    train_step(model, x, contextlib.nullcontext())
    assert bitsparse.stats().tensors_compressed == 2  # the first enable() still applies


def test_disable_without_enable_is_a_no_op():
    assert not bitsparse.is_enabled()
    bitsparse.disable()
    bitsparse.disable()
    assert not bitsparse.is_enabled()


def test_enable_is_thread_local():
    bitsparse.enable(**OPTIONS)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(bitsparse.is_enabled()))
    thread.start()
    thread.join()
    assert seen == [False]


# --------------------------------------------------------------------------------------------
# Option errors


def test_unknown_option():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        with bitsparse.compressing(bogus=1):
            pass
    with pytest.raises(TypeError, match="bogus"):
        bitsparse.enable(bogus=1)
    assert not bitsparse.is_enabled()


def test_options_are_keyword_only_and_match_their_defaults():
    import inspect

    defaults = Options()
    for api in (bitsparse.compressing, bitsparse.enable):
        params = inspect.signature(api).parameters
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
        assert {name: p.default for name, p in params.items()} == {
            f: getattr(defaults, f) for f in Options.__dataclass_fields__
        }


@pytest.mark.parametrize(
    "options, message",
    [
        ({"capacity": -1}, "capacity must be 'auto', a number of bytes"),
        ({"capacity": 0}, "capacity must be 'auto', a number of bytes"),
        ({"capacity": 63}, r"an int >= 4096"),
        ({"capacity": 4095}, r"an int >= 4096"),
        ({"capacity": 1.5}, r"float in \(0, 1\]"),
        ({"capacity": 0.0}, "capacity must be"),
        ({"capacity": True}, "capacity must be"),
        ({"capacity": "big"}, "capacity must be"),
        ({"select": "x"}, r"select must be one of \('relu', 'all'\), got 'x'"),
        ({"window": 0}, "window must be None or an int >= 1, got 0"),
        ({"window": 1.5}, "window must be None or an int >= 1"),
        ({"min_numel": -1}, "min_numel must be an int >= 0, got -1"),
        ({"backend": "cuda"}, r"backend must be None, 'torch' or 'triton', got 'cuda'"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_bad_option_values(options, message):
    _check_refused(options, ValueError, message)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sign_pack": "no"}, "sign_pack must be True or False, got 'no'"),
        ({"recompute_squares": "no"}, "recompute_squares must be True or False, got 'no'"),
        ({"host_spill": 0}, "host_spill must be True or False, got 0"),
        ({"sign_pack": 1}, "sign_pack must be True or False"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else "",
)
def test_bad_option_types(options, message):
    _check_refused(options, TypeError, message)


def _check_refused(options, error, message):
    """Refused when given: by compressing() before its block runs, and by enable()."""
    with pytest.raises(error, match=message):
        bitsparse.compressing(**options)
    with pytest.raises(error, match=message):
        bitsparse.enable(**options)
    assert not bitsparse.is_enabled()
    assert not hooks_installed()


def test_options_are_checked_again_for_an_equal_value_of_another_type():
    """Checked options are kept, by value and type: 1 and True, equal to 1.0, are refused as a
    capacity after 1.0 was accepted, and 1 as sign_pack after True."""
    bitsparse.compressing(capacity=1.0)
    bitsparse.compressing(sign_pack=True)
    refused = [({"capacity": 1}, ValueError), ({"capacity": True}, ValueError), ({"sign_pack": 1}, TypeError)]
    for options, error in refused:
        with pytest.raises(error):
            bitsparse.compressing(**options)
    assert bitsparse.compressing(window=2).options is bitsparse.compressing(window=2).options


def test_good_option_values():
    for options in [{"capacity": 1 << 20}, {"capacity": 0.01}, {"capacity": "auto"}, {"window": 1},
                    {"select": "all"}, {"backend": "torch"}, {"min_numel": 0}]:
        with bitsparse.compressing(**options):
            pass


@pytest.mark.parametrize("value", [3, 3.0, None, [1.0]])
def test_mark_non_tensor(value):
    with pytest.raises(TypeError, match=f"mark expects a torch.Tensor, got {type(value).__name__}"):
        bitsparse.mark(value)


# --------------------------------------------------------------------------------------------
# Threads


def test_two_threads_train_concurrently(monkeypatch):
    # Which step a thread's statistics show depends on the other's timing: count what the
    # session stores instead.
    stored = []
    store = manager.Session._store

    def counting_store(self, *args):
        handle = store(self, *args)
        stored.append(handle.fixed is not None)
        return handle

    monkeypatch.setattr(manager.Session, "_store", counting_store)
    models = [mlp(seed=0), mlp(d_in=48, hidden=192, seed=1)]
    inputs = [mlp_input(3), mlp_input(4, batch=96, d_in=48)]
    expected = [train_step(m, x, contextlib.nullcontext()) for m, x in zip(models, inputs)]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker(i):
        try:
            for _ in range(4):
                barrier.wait(timeout=30)
                got = train_step(models[i], inputs[i], bitsparse.compressing(**OPTIONS))
                assert_same_grads(got, expected[i])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    assert alive() == 0
    assert any(stored), "no tensor was compressed"


def test_hooks_are_thread_local():
    """While one thread is inside compressing(), another thread's forward is not compressed."""
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    inside, done = threading.Event(), threading.Event()
    errors = []

    def holder():
        try:
            with bitsparse.compressing(**OPTIONS):
                inside.set()
                done.wait(timeout=30)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(timeout=30)
        other_model, other_x = mlp(), mlp_input()
        before = bitsparse.stats().as_dict()
        assert_same_grads(train_step(other_model, other_x, contextlib.nullcontext()), expected)
        assert bitsparse.stats().as_dict() == before
    finally:
        done.set()
        thread.join(timeout=30)
    assert not errors


# --------------------------------------------------------------------------------------------
# Never worse off: the arena follows demand, and nothing a user does disables the library


def test_the_first_step_only_measures_and_the_second_has_room_for_it():
    model, x = transformer(), sequence_input()
    expected = train_step(model, x, contextlib.nullcontext())
    stats = []
    for _ in range(3):
        assert_same_grads(train_step(model, x, bitsparse.compressing(min_numel=MIN_NUMEL)), expected)
        stats.append(bitsparse.stats())
    first, second, third = stats
    # First step: every candidate kept dense (measured in host memory), squares still
    # recomputed from them; the arena holds no memory at all, not even a counter.
    assert first.tensors_compressed == 0 and first.fallbacks == {"arena_full": 3}
    assert first.tensors_recomputed == 3 and first.arena_reserved == 0
    # Then everything fits, in an arena sized to the demand plus 15%.
    for s in (second, third):
        assert s.tensors_compressed == 3 and s.fallbacks == {}
        assert s.arena_peak <= s.arena_reserved < 1.25 * s.stored_bytes + 4096
    assert second.arena_reserved == third.arena_reserved


@pytest.mark.parametrize("shift", [2.0, 0.0], ids=["90%_zeros", "50%_zeros"])
def test_batches_of_two_sizes_in_turn(shift):
    # A batch of 512 rows, then one of 64, in turn (two models trained by turns, or lengths
    # that differ from step to step). With 90% zeros every step stores every ReLU output once
    # both sizes were seen; at 50% the big step's tensors need more room than the small step's
    # take dense. Either way no step holds more with the arena than without it.
    model = mlp()
    with torch.no_grad():
        model[0].bias -= shift
        model[2].bias -= shift
    inputs = [mlp_input(batch=512), mlp_input(batch=64)]
    expected = [train_step(model, x, contextlib.nullcontext()) for x in inputs]
    for step in range(6):
        got = train_step(model, inputs[step % 2], bitsparse.compressing(min_numel=MIN_NUMEL))
        assert_same_grads(got, expected[step % 2])
        s = bitsparse.stats()
        if step >= 2:
            assert s.arena_reserved <= s.dense_bytes + 4096, str(s)  # the arena's counters and start words
            if shift:
                assert s.tensors_compressed == 2 and s.fallbacks == {}, str(s)


def test_new_options_keep_the_one_arena_and_its_size():
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    reserved = []
    for options in ({}, {}, {"sign_pack": True}, {"window": 2}, {"recompute_squares": False}):
        assert_same_grads(train_step(model, x, bitsparse.compressing(min_numel=MIN_NUMEL, **options)), expected)
        s = bitsparse.stats()
        reserved.append(s.arena_reserved)
        if len(reserved) > 1:
            assert s.tensors_compressed == 2 and s.fallbacks == {}, str(s)
    assert reserved[1] == max(reserved[1:])  # no second arena, no new initial size


class FailingCodec:
    """The torch codec, whose (prepared) encoder raises once with ``error`` (an out-of-memory, Ctrl-C)."""

    def __init__(self, error: BaseException):
        self.error, self.name = error, "torch"

    def __getattr__(self, name):
        return getattr(torch_codec, name)

    def encoder(self, *args):
        encode_into = torch_codec.encoder(*args)

        def failing_once(*call):
            if self.error is not None:
                error, self.error = self.error, None
                raise error
            return encode_into(*call)

        return failing_once


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), torch.OutOfMemoryError("CUDA out of memory")], ids=["ctrl_c", "oom"]
)
def test_an_exception_while_storing_leaves_the_library_working(monkeypatch, error):
    import bitsparse.hooks.manager as manager

    codec = FailingCodec(error)
    monkeypatch.setattr(manager, "get_codec", lambda backend, device: codec)
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    with pytest.raises(type(error)):
        without_traceback(train_step, model, x, bitsparse.compressing(**OPTIONS))
    gc.collect()
    assert alive() == 0 and not hooks_installed()
    for _ in range(12):
        assert_same_grads(train_step(model, x, bitsparse.compressing(**OPTIONS)), expected)
        s = bitsparse.stats()
        assert s.tensors_compressed == 2 and s.fallbacks == {}, str(s)


def test_a_step_whose_arena_the_device_has_no_room_for_keeps_its_tensors_and_the_next_store_in_less(monkeypatch):
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    options = {"min_numel": MIN_NUMEL}  # the first step measures; the second is planned an arena
    for _ in range(2):
        train_step(model, x, bitsparse.compressing(**options))
    planned = bitsparse.stats().arena_reserved
    bitsparse.reset()
    train_step(model, x, bitsparse.compressing(**options))
    monkeypatch.setattr(arena_module, "torch", NoRoomForBuffers())
    with pytest.warns(RuntimeWarning, match="no room on cpu for its arena"):
        assert_same_grads(train_step(model, x, bitsparse.compressing(**options)), expected)
    s = bitsparse.stats()
    assert s.tensors_compressed == 0 and s.fallbacks == {"out_of_memory": 2} and s.arena_reserved == 0, str(s)
    monkeypatch.undo()
    for _ in range(2):
        assert_same_grads(train_step(model, x, bitsparse.compressing(**options)), expected)
        s = bitsparse.stats()
        assert s.tensors_compressed == 1 and s.fallbacks == {"arena_full": 1}, str(s)
        assert 0 < s.arena_reserved <= planned // 2
    assert alive() == 0


def test_an_explicit_capacity_the_device_has_no_room_for_is_refused_with_what_to_pass(monkeypatch):
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    monkeypatch.setattr(arena_module, "torch", NoRoomForBuffers())
    with pytest.raises(torch.OutOfMemoryError, match=r"capacity=1048576 asks for .* pass a smaller capacity"):
        without_traceback(train_step, model, x, bitsparse.compressing(**OPTIONS))
    assert not hooks_installed()
    monkeypatch.undo()
    gc.collect()
    assert alive() == 0
    for _ in range(2):  # the same capacity, once the device has room
        assert_same_grads(train_step(model, x, bitsparse.compressing(**OPTIONS)), expected)
        assert bitsparse.stats().tensors_compressed == 2


class CtrlC:
    """A tracer that raises KeyboardInterrupt at the ``at``-th line BitSparse's own Python
    runs (``at`` 0: none, only counting them; with ``within``, a function, counting only the
    lines run within a call of it), as Ctrl-C may anywhere, with two exceptions.
    While a block exits: no Python code can keep Ctrl-C from landing as its ``__exit__``
    begins (torch's own ``saved_tensors_hooks`` included), and ``with`` does not call it
    again. And at a ``with`` statement's line, which a tracer also sees as the block ends,
    right before ``__exit__`` runs, where Ctrl-C cannot land (CPython takes signals on calls,
    function entries and backward jumps)."""

    PACKAGES = tuple(
        str(pathlib.Path(package.__file__).resolve().parent) + "/"
        for package in (bitsparse, bitsparse.hooks, bitsparse.allocator)  # three folders: see pyproject.toml
    )
    MODELS = str(pathlib.Path(bitsparse.bench.__file__).resolve().parent) + "/"
    """The benchmarks' models, which some workloads train: the user's code, not BitSparse's."""

    def __init__(self, at: int, within=None):
        self.at, self.lines, self.exiting = at, 0, False
        self.within = None if within is None else within.__code__

    def __call__(self, frame, event, arg):
        if frame.f_code is bitsparse.compressing.__exit__.__code__:
            self.exiting = True
            return self.exit
        filename = frame.f_code.co_filename
        if self.exiting or not filename.startswith(self.PACKAGES) or filename.startswith(self.MODELS):
            return None
        return self.line

    def exit(self, frame, event, arg):
        self.exiting = event != "return"
        return self.exit

    @staticmethod
    def at_with(frame) -> bool:
        return linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip().startswith("with ")

    def inside(self, frame) -> bool:
        """Whether ``frame`` runs within a call of the function ``within`` (any, if None)."""
        while self.within is not None and frame is not None and frame.f_code is not self.within:
            frame = frame.f_back
        return frame is not None

    def line(self, frame, event, arg):
        if event == "line" and not self.at_with(frame) and self.inside(frame):
            self.lines += 1
            if self.lines == self.at:
                raise KeyboardInterrupt
        return self.line


def mlp_steps():
    """The sweeps' default workload: training steps of the MLP (``ctrl_c_sweep``)."""
    model, x = mlp(), mlp_input()

    def step(options):
        return train_step(model, x, contextlib.nullcontext() if options is None else bitsparse.compressing(**options))

    return step, 2


def pipeline_iterations():
    """Iterations of a 1F1B stage, 8 microbatches, 3 in flight (``ctrl_c_sweep``)."""
    model, inputs = pipeline_stage(0.9)
    schedule = one_f_one_b(len(inputs), 3)
    return (lambda options: run_pipeline(model, inputs, schedule, options)[0]), len(model.layers)


def ctrl_c_sweep(
    interruptions: int, options: dict = OPTIONS, whole_steps: int = 1, workload=mlp_steps, within=None
) -> int:
    """Interrupt a step of ``workload()`` (which returns a function that runs a step, or a
    pipeline's iteration, under ``compressing(**options)``, or dense for None, and returns
    its gradients; and how many tensors a step stores) at ``interruptions`` lines of
    BitSparse's Python spread evenly over all it runs in the step (pack, store, arena
    allocation, unpack, release; with ``within``, a function, over the lines run within calls
    of it), each in a fresh session after ``whole_steps`` whole steps, and check after each
    that the library goes on working: hooks removed, exact gradients, statistics that add up,
    every tensor compressed again once the interrupted step has left the arena's sizing,
    nothing left alive. Returns how many lines the sweep could interrupt."""
    step, stored = workload()
    expected = step(None)

    def interrupted_step(tracer: CtrlC) -> None:
        bitsparse.reset()
        for _ in range(whole_steps):  # with an explicit capacity, the next step allocates the arena
            step(options)
        sys.settrace(tracer)
        try:
            step(options)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)

    counting = CtrlC(0, within)
    interrupted_step(counting)
    hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_drop_interrupts, hook)
    try:
        for at in range(1, counting.lines + 1, max(1, counting.lines // interruptions)):
            interrupted_step(CtrlC(at, within))
            if alive():  # what the interrupted step's frames hold in cycles
                gc.collect()
            assert not hooks_installed(), at
            # The first step continues the interrupted one (no backward ended it), whose counts
            # the interrupt may have cut between two updates. It may count as a small step,
            # whose size caps the arena for the next DEMAND_STEPS steps (so that such a step is
            # never worse off): fewer tensors may fit until then, all of them after. The cap
            # can only lift, so the steps after one that compresses every tensor do too.
            for attempt in range(DEMAND_STEPS + 2):
                assert_same_grads(step(options), expected)
                s = bitsparse.stats()
                if attempt:
                    check_consistent(s)
                    if (s.tensors_compressed, s.fallbacks) == (stored, {}):
                        break
            assert (s.tensors_compressed, s.fallbacks) == (stored, {}), (at, str(s))
            if alive():
                gc.collect()
            assert alive() == 0, at
    finally:
        sys.unraisablehook = hook
    return counting.lines


def _drop_interrupts(hook, unraisable) -> None:
    """Drop a KeyboardInterrupt raised in a finalizer (a lease released by the garbage
    collector) once Python has passed it over, as Python's own hook does after printing it;
    pytest's would keep it, and the objects its traceback holds, to the test's end."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        hook(unraisable)


def test_ctrl_c_anywhere_in_a_step_leaves_the_library_working():
    """Ctrl-C lands wherever the host is, inside BitSparse's Python too (a forward the host
    bounds spends much of its time there): wherever it lands, the library goes on working.
    Here at 60 places spread over the step; ``ctrl_c_sweep(lines)`` tries every line."""
    assert ctrl_c_sweep(60) > 200


def test_ctrl_c_in_a_release_callback_leaves_its_site_stored(monkeypatch):
    """Ctrl-C in the callback that hears of a stored tensor's original being released (it
    runs wherever the release happens, as the forward returns): the site is stored at every
    later step, as the callback only ever finds a tensor held, never one freed."""
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    ended, calls = manager.Session._watch_ended, []

    def cut_short(session, watch):
        calls.append(watch)
        if len(calls) == 1:
            raise KeyboardInterrupt
        ended(session, watch)

    monkeypatch.setattr(manager.Session, "_watch_ended", cut_short)
    monkeypatch.setattr(sys, "unraisablehook", functools.partial(_drop_interrupts, sys.unraisablehook))
    for _ in range(3):
        assert_same_grads(train_step(model, x, bitsparse.compressing(**OPTIONS)), expected)
        assert bitsparse.stats().tensors_compressed == 2
    assert len(calls) == 6


def test_ctrl_c_on_the_last_line_of_a_blocks_entry_leaves_no_block_in_effect():
    """Ctrl-C as ``compressing.__enter__`` returns, its entry recorded: ``with`` calls no
    ``__exit__``, so the entry itself must be undone, or this thread would count a block in
    effect for good (``reset`` refused, the options of a block that never ran)."""
    enter = bitsparse.compressing.__enter__
    lines, first = inspect.getsourcelines(enter)
    target = first + next(i for i, line in enumerate(lines) if line.strip() == "return self")

    def tracer(frame, event, arg):
        if frame.f_code is not enter.__code__:
            return None

        def line(frame, event, arg):
            if event == "line" and frame.f_lineno == target:
                raise KeyboardInterrupt
            return line

        return line

    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            with bitsparse.compressing(**OPTIONS):
                pass
    finally:
        sys.settrace(None)
    assert not hooks_installed()
    bitsparse.reset()  # refused while a block is in effect
    assert_same_grads(train_step(model, x, bitsparse.compressing(**OPTIONS)), expected)
    assert bitsparse.stats().tensors_compressed == 2


def test_ctrl_c_anywhere_in_a_first_step_leaves_the_library_working():
    """The same for a first step of an arena sized by demand, which measures in host memory."""
    assert ctrl_c_sweep(30, {"min_numel": MIN_NUMEL}, whole_steps=0) > 100


def test_ctrl_c_anywhere_in_a_pipeline_iteration_leaves_the_library_working():
    """The same for the first iteration of a pipeline stage, whose overlapping steps are
    served by arenas of their own, made, planned and released as each step begins: at 60
    places spread over the steps' starts (``Session._begin_step``)."""
    assert ctrl_c_sweep(60, {}, whole_steps=0, workload=pipeline_iterations, within=manager.Session._begin_step) > 500


def test_a_block_inside_enable_stores_with_its_own_options_and_enable_with_its_own_after():
    """``enable()`` and a block inside it share their hooks when they select alike (so that
    compiled graphs serve both): each stores with its own options while it is innermost."""
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    stored = []
    bitsparse.enable(**OPTIONS)
    try:
        inner = bitsparse.compressing(**OPTIONS, sign_pack=True)
        for ctx in (contextlib.nullcontext(), inner, contextlib.nullcontext()):
            assert_same_grads(train_step(model, x, ctx), expected)
            s = bitsparse.stats()
            assert s.tensors_compressed == 2, str(s)
            stored.append(s.stored_bytes)
    finally:
        bitsparse.disable()
    assert stored[1] < stored[0] == stored[2]


def test_a_block_entered_inside_itself_or_ended_out_of_order_leaves_nothing_on():
    """One ``compressing`` object entered again inside itself, and blocks that end in another
    order than they began (generators closed in the order they were opened): each entry
    undoes what it did, and each block stores with its own options while it is in effect."""
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    block = bitsparse.compressing(**OPTIONS)
    with block:
        with block:
            assert_same_grads(train_step(model, x, contextlib.nullcontext()), expected)
        assert hooks_installed()
    assert not hooks_installed()
    block.__exit__(None, None, None)  # ended already (a disable() cut short and called again): nothing
    assert not hooks_installed()

    def compressed_with(options):
        with bitsparse.compressing(**OPTIONS, **options):
            yield

    assert_same_grads(train_step(model, x, bitsparse.compressing(**OPTIONS)), expected)
    unpacked_bytes = bitsparse.stats().stored_bytes
    first, second = compressed_with({}), compressed_with({"sign_pack": True})
    next(first), next(second)
    first.close()  # ends before the block that began inside it, whose options stay in effect
    assert_same_grads(train_step(model, x, contextlib.nullcontext()), expected)
    s = bitsparse.stats()
    assert s.tensors_compressed == 2 and s.stored_bytes < unpacked_bytes, str(s)
    second.close()
    assert not hooks_installed()
    bitsparse.reset()  # refused while a block is in effect
    assert_same_grads(train_step(model, x, bitsparse.compressing(**OPTIONS)), expected)


def test_enable_inside_a_users_hooks_block_is_refused():
    model, x = mlp(), mlp_input()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(RuntimeError, match="inside a saved_tensors_hooks block opened outside BitSparse"):
            bitsparse.enable(**OPTIONS)
        assert not bitsparse.is_enabled()
    bitsparse.enable(**OPTIONS)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(RuntimeError, match="enable\\(\\) was called inside a saved_tensors_hooks block"):
            bitsparse.enable(**OPTIONS)
        with pytest.raises(RuntimeError, match="disable\\(\\) was called inside a saved_tensors_hooks block"):
            bitsparse.disable()
    # The user's block is gone and BitSparse's hooks are still the ones installed.
    expected_alive = 2
    zero_grads(model, x)
    out = model(x)
    assert alive() == expected_alive
    loss_of(out).backward()
    bitsparse.disable()
    assert not hooks_installed()


def test_steps_that_store_nothing_each_have_their_own_stats_under_enable():
    model, x = mlp(), mlp_input()
    bitsparse.enable(min_numel=1 << 30)  # nothing is stored
    steps = []
    for _ in range(3):
        train_step(model, x, contextlib.nullcontext())
        s = bitsparse.stats()
        steps.append((s.step, s.tensors_seen))
    assert steps == [(steps[0][0] + i, steps[0][1]) for i in range(3)] and steps[0][1] > 0


@pytest.mark.parametrize("activation", ["silu", "relu", "relu_without_zeros"])
def test_steps_with_nothing_to_compress_are_warned_about_once(activation):
    """A model without ReLU-family activations: once its saved tensors had none to compress
    for ``IDLE_STEPS_BEFORE_WARNING`` steps, the user is told, once, that the hooks only cost
    host time there. Not a model with ReLU outputs, even where none pays (a save site learned
    not to shrink is a decision, not a lack of candidates)."""
    torch.manual_seed(0)
    fc = nn.Linear(32, 256)
    if activation == "relu_without_zeros":
        with torch.no_grad():
            fc.bias.fill_(100.0)
    model = nn.Sequential(fc, nn.SiLU() if activation == "silu" else nn.ReLU(), nn.Linear(256, 10))
    x = mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, manager.IDLE_STEPS_BEFORE_WARNING + 4):
            assert_same_grads(train_step(model, x, bitsparse.compressing(**OPTIONS)), expected)
            idle = [w for w in caught if "compressed nothing" in str(w.message)]
            # A step is noted as the next one begins.
            assert len(idle) == (activation == "silu" and step > manager.IDLE_STEPS_BEFORE_WARNING)
    assert all(w.category is RuntimeWarning for w in idle)
    if activation == "relu_without_zeros":
        assert bitsparse.stats().tensors_skipped.get("unprofitable_site", 0) > 0


def test_the_warning_about_nothing_to_compress_raised_as_an_error_leaves_steps_exact():
    """Run with warnings as errors, the warning raises out of the forward that begins the next
    step; that step has begun, and the steps after it give the same gradients."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(32, 256), nn.SiLU(), nn.Linear(256, 10)), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(manager.IDLE_STEPS_BEFORE_WARNING):
            assert_same_grads(train_step(model, x, bitsparse.compressing(**OPTIONS)), expected)
        with pytest.raises(RuntimeWarning, match="compressed nothing"):
            train_step(model, x, bitsparse.compressing(**OPTIONS))
        for _ in range(2):
            assert_same_grads(train_step(model, x, bitsparse.compressing(**OPTIONS)), expected)
    assert bitsparse.stats().tensors_skipped.get("not_relu_family", 0) > 0


def test_a_graph_kept_without_backward_leaves_the_steps_after_it_an_arena_of_their_own():
    """An evaluation forward with gradients enabled, kept in a variable, holds its compressed
    tensors in the arena that served it: the training steps after it are served by another,
    store every tensor and keep exact gradients; once the graph goes, the first arena serves
    again and the other lets its buffer go."""
    model, x = mlp(), mlp_input()
    expected = train_step(model, x, contextlib.nullcontext())
    options = {"min_numel": MIN_NUMEL}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert_same_grads(train_step(model, x, bitsparse.compressing(**options)), expected)
        reserved = bitsparse.stats().arena_reserved
        with bitsparse.compressing(**options):
            kept = model(mlp_input(9))
        for _ in range(3):
            assert_same_grads(train_step(model, x, bitsparse.compressing(**options)), expected)
            s = bitsparse.stats()
        assert s.fallbacks == {} and s.tensors_compressed == 2 and alive() == 2, str(s)
        assert s.arena_reserved > reserved  # the first arena's buffer, and the other's
        both = s.arena_reserved
        del kept
        gc.collect()
        for _ in range(2):
            assert_same_grads(train_step(model, x, bitsparse.compressing(**options)), expected)
            s = bitsparse.stats()
    # One arena again (planned for the larger step of the evaluation's and the training's).
    assert s.fallbacks == {} and s.tensors_compressed == 2 and s.arena_reserved < both, str(s)


def test_a_graph_that_lives_through_one_more_step_finds_room_from_then_on():
    """A GAN's generator output feeds the discriminator's step, whose backward ends it, and
    then the generator's step: the generator's compressed tensors stay alive through the
    discriminator's backward into the forward of the generator's loss, a step that an arena of
    its own serves. Once the demands of the first steps,
    which only measured, have aged out, every tensor of both steps is compressed, and nothing
    is warned about. Gradients stay exact all along."""
    generator, discriminator = mlp(d_out=32, seed=1), mlp(d_out=1, seed=2)
    z, real = mlp_input(3), mlp_input(4)

    def gan_step(ctx):
        zero_grads(generator, z)
        zero_grads(discriminator, real)
        with ctx:
            fake = generator(z)
            d_loss = discriminator(real).mean() - discriminator(fake.detach()).mean()
        d_loss.backward()
        with ctx:
            g_loss = -discriminator(fake).mean()
        g_loss.backward()
        return grads(generator, z) + grads(discriminator, real)

    expected = gan_step(contextlib.nullcontext())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(DEMAND_STEPS + 3):
            assert_same_grads(gan_step(bitsparse.compressing(min_numel=MIN_NUMEL)), expected)
    s = bitsparse.stats()  # of the generator's step
    assert s.fallbacks == {} and s.tensors_compressed == 2, str(s)
    with bitsparse.compressing(min_numel=MIN_NUMEL):  # the discriminator's step, with the generator's
        fake = generator(z)
        discriminator(fake.detach()).mean().backward()
    s = bitsparse.stats()
    assert s.fallbacks == {} and s.tensors_compressed == 4, str(s)
    del fake
    assert alive() == 0


def test_torch_func_transforms_refuse_saved_tensor_hooks():
    """A PyTorch limitation the docs state: torch.func.grad will not run under any
    saved-tensor hooks; outside the block it runs as usual."""
    x = torch.randn(4096)

    def f(t):
        return torch.relu(t).square().sum()

    with bitsparse.compressing(**OPTIONS):
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            torch.func.grad(f)(x)
    assert_bitwise_equal(torch.func.grad(f)(x), 2 * torch.relu(x))


def test_a_step_begins_at_its_first_saved_tensor_not_at_a_blocks_entry():
    """Entering ``compressing()`` leaves the last step as it is (its statistics stay
    readable); the new step, and its host work, begins with the forward's first saved tensor."""
    model, x = mlp(), mlp_input()
    train_step(model, x, bitsparse.compressing(**OPTIONS))
    step = bitsparse.stats().step
    with bitsparse.compressing(**OPTIONS):
        assert bitsparse.stats().step == step and bitsparse.stats().tensors_compressed == 2
        out = model(x)
        assert bitsparse.stats().step == step + 1
    loss_of(out).backward()
