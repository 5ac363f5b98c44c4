"""BitSparse inside ``torch.compile``, next to the eager numerics tests: the ReLU-family tensors a
compiled forward saves are compressed in the compiled graph and restored in the compiled
backward, with gradients bit-identical to the same compiled model without BitSparse.

Inductor runs on the CPU here. Each test compiles its model with a compile counter, so that
it also checks that steps under ``compressing()`` do not compile again.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re

import pytest
import torch
import torch.nn as nn
from helpers import assert_bitwise_equal, compress_relu_of, generator
from test_hooks import (  # noqa: F401 (clean_session: autouse fixture, reporting_arenas: fixture)
    ARENA,
    OPTIONS,
    Block,
    CustomMLP,
    LaggingDevice,
    alive,
    assert_same_grads,
    clean_session,
    convnet,
    expected_nbytes,
    image_input,
    mlp,
    mlp_input,
    reporting_arenas,
    seeded,
    sequence_input,
    train_step,
    transformer,
)
from test_provenance import ReluThen
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import bitsparse
from bitsparse.allocator.arena import DEMAND_STEPS
from bitsparse.bench.models import GPT, GPTConfig
from bitsparse.hooks import compiled_ops, handles


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fused_backwards_on_the_cpu(monkeypatch):
    """Let the CPU's compiled backwards restore ReLU outputs into their squares' backward (a
    test's inputs then hold no element where a ReLU output and its gradient are both NaNs,
    see ``FUSED_BACKWARD_DEVICES``)."""
    monkeypatch.setattr("bitsparse.hooks.graph_passes.FUSED_BACKWARD_DEVICES", ("cuda", "cpu"))


def compiled_steps(model, x, steps=3, compile=None, **options):
    """The compiled model's plain gradients, then ``steps`` steps under ``compressing()`` with
    the same gradients bit for bit; their stats and the number of frames compiled."""
    counter = CompileCounterWithBackend("inductor")
    compiled = compile(model, counter) if compile else torch.compile(model, backend=counter)
    expected = train_step(compiled, x, contextlib.nullcontext())
    frames = counter.frame_count
    stats = []
    for _ in range(steps):
        assert_same_grads(train_step(compiled, x, bitsparse.compressing(**{**OPTIONS, **options})), expected)
        stats.append(bitsparse.stats())
    return stats, counter.frame_count - frames, counter


def fullgraph(model, counter):
    return torch.compile(model, backend=counter, fullgraph=True)


def test_compiled_mlp_compresses_its_relu_outputs_exactly():
    model, x = mlp(), mlp_input()
    stats, frames, _ = compiled_steps(model, x, steps=5)
    assert frames == 1  # once for the hooks, then never again
    # The two ReLU outputs, stored in the arena with the bytes the format gives them.
    h1 = torch.relu(model[0](x)).detach()
    h2 = torch.relu(model[2](h1)).detach()
    nbytes = expected_nbytes(h1)[0] + expected_nbytes(h2)[0]
    for s in stats:
        assert (s.tensors_seen, s.tensors_compressed, s.fallbacks) == (2, 2, {})
        assert s.dense_bytes == h1.numel() * 4 + h2.numel() * 4 and s.stored_bytes == nbytes
    assert alive() == 0


class ClampToUnit(nn.Module):
    def forward(self, x):
        return x.clamp(0, 1)


@pytest.mark.parametrize(
    "activation",
    [nn.ReLU6(), nn.Hardtanh(0.0, 2.0), ClampToUnit()],
    ids=["relu6", "hardtanh(0, 2)", "clamp(0, 1)"],
)
def test_compiled_bounded_relus_are_compressed(activation):
    """A compiled graph spells a ReLU with an upper bound as ``clamp_max(clamp_min(x, 0), b)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), activation, nn.Linear(256, 10))
    stats, frames, _ = compiled_steps(model, mlp_input())
    assert frames == 1
    assert [s.tensors_compressed for s in stats] == [1, 1, 1]


@pytest.mark.parametrize("fallback_random", [False, True], ids=["inductor_random", "native_dropout"])
def test_compiled_dropout_of_a_relu_is_stored(monkeypatch, fallback_random):
    """Inductor compiles dropout as ``relu * mask * scale``, with a mask of its own random
    numbers (or, with ``fallback_random``, as ATen's ``native_dropout``, whose outputs are its
    values and its mask), and the graph saves the values for the next Linear: stored with
    the bytes the format gives them, gradients bit-identical to the compiled model's without
    BitSparse from the same seed, and the boolean masks kept as they are."""
    stored = []
    store = compiled_ops._stored
    monkeypatch.setattr(compiled_ops, "_stored", lambda x, *args: stored.append(x.clone()) or store(x, *args))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.25), nn.Linear(256, 10))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    x = mlp_input()
    with torch._inductor.config.patch(fallback_random=fallback_random):
        expected = train_step(compiled, x, seeded(contextlib.nullcontext()))
    for _ in range(3):
        stored.clear()
        with torch._inductor.config.patch(fallback_random=fallback_random):
            assert_same_grads(train_step(compiled, x, seeded(bitsparse.compressing(**OPTIONS))), expected)
        s = bitsparse.stats()
        (product,) = stored
        assert (s.tensors_compressed, s.fallbacks, s.dense_bytes) == (1, {}, 64 * 256 * 4)
        assert s.stored_bytes == expected_nbytes(product)[0] and (product == 0).float().mean() > 0.6
    assert counter.frame_count == 2 and alive() == 0  # once without the hooks, once with


@pytest.mark.parametrize("after", ["reglu", "relu2_glu"])
def test_compiled_gated_relus_store_the_relu_output_and_compute_the_product_again(monkeypatch, after):
    """A ReGLU's graph, ``out(relu(fc(x)) * up(x))``, saves the ReLU output, stored, and
    ``up(x)``, and computes the product again in the backward; a ReLU²-GLU's its square too.
    Gradients are bit-identical to the compiled model's without BitSparse, and what is stored
    is one ReLU output (given to the store as the ReLU's input where the op also squares it),
    with the bytes the format gives it."""
    stored = []
    store = compiled_ops._stored
    monkeypatch.setattr(compiled_ops, "_stored", lambda x, *args: stored.append(x.clone()) or store(x, *args))
    model = ReluThen(after)
    stats, frames, _ = compiled_steps(model, torch.randn(4, 16, 32, requires_grad=True))
    relu = torch.relu(stored[-1])
    assert frames == 1 and len(stored) == 3 and (relu == 0).float().mean() > 0.7
    s = stats[-1]
    assert (s.tensors_compressed, s.fallbacks, s.dense_bytes) == (1, {}, relu.numel() * 4)
    assert s.stored_bytes == expected_nbytes(relu)[0]


@pytest.mark.usefixtures("fused_backwards_on_the_cpu")
@pytest.mark.parametrize("variant", [0, 1, 2], ids=["relu_square", "square_of_relu", "inplace_relu_on_a_view_pow"])
def test_compiled_relu_squared_block_saves_the_relu_and_recomputes_the_square(variant):
    """Only the ReLU output is stored (the partitioner recomputes its square from it), by the
    op that squares it (``fuse_relu_squares``): the forward reads the ReLU's input once, and
    computes no ReLU of its own. The backward restores it by the op that writes its square
    and its input's gradient (``fuse_relu_square_backwards``), and writes no ReLU output
    (``fc`` without a bias, whose gradient would sum that gradient in inductor's kernel)."""
    import re

    torch.manual_seed(0)
    model = nn.Sequential(Block(32, variant, nn.LayerNorm))
    model[0].fc.bias = None
    steps = []
    codes = _generated_code(lambda: steps.append(compiled_steps(model, sequence_input())))
    ((stats, frames, _),) = steps
    assert frames == 1
    for s in stats:
        assert (s.tensors_seen, s.tensors_compressed, s.fallbacks) == (1, 1, {}), str(s)
        assert s.dense_bytes == 4 * 16 * 128 * 4
    (forward,) = [code for code in codes if "bitsparse.functions.store" in code]
    (backward,) = [code for code in codes if "bitsparse.functions.restore" in code]
    assert forward.count("torch.ops.bitsparse.functions.store_relu_square(") == 1
    assert "torch.ops.bitsparse.functions.store(" not in forward
    assert not re.search(r"(cpp|triton)_\w*relu", forward)
    assert backward.count("torch.ops.bitsparse.functions.restore_relu_square_backward(") == 1
    assert "torch.ops.bitsparse.functions.restore_into(" not in backward
    # The generated code calls the ops' functions, not the ops through the dispatcher.
    assert not re.search(r"torch\.ops\.bitsparse\.\w+\.default\(", forward + backward)


def test_compiled_transformer_stack_whole_and_per_block():
    whole, frames, _ = compiled_steps(transformer(), sequence_input(), compile=fullgraph)
    assert frames == 1
    assert [s.tensors_compressed for s in whole] == [3, 3, 3]

    def per_block(model, counter):
        for block in model:
            block.compile(backend=counter)
        return model

    torch._dynamo.reset()
    blocks, frames, counter = compiled_steps(transformer(), sequence_input(), compile=per_block)
    # Each compiled region once more for the hooks, and never again: the three blocks, and from
    # torch 2.14 the final LayerNorm (which saves nothing to compress), compiled there as well.
    assert frames == counter.frame_count - frames and frames in (3, 4)
    assert [s.tensors_compressed for s in blocks] == [3, 3, 3]


def test_dynamic_shapes_compile_once_for_every_length():
    """``dynamic=True``: the stored tensors' sizes and strides are symbols of the forward,
    which the backward receives; one compile serves every sequence length, exactly."""
    check_dynamic_shapes(torch.device("cpu"), torch.float32)


def check_dynamic_shapes(device: torch.device, dtype: torch.dtype) -> None:
    model = transformer().to(device, dtype)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, dynamic=True)
    frames = []
    for length in (40, 24, 16):  # longest first: the arena follows demand, and a longer step falls back once
        x = torch.randn(4, length, 32, generator=generator("dynamic", length)).to(device, dtype).requires_grad_()
        expected = train_step(compiled, x, contextlib.nullcontext())
        frames.append(counter.frame_count)
        assert_same_grads(train_step(compiled, x, bitsparse.compressing(**OPTIONS)), expected)
        assert bitsparse.stats().tensors_compressed == 3
    assert counter.frame_count == frames[0] + 1  # once more, for the hooks


@pytest.mark.parametrize("min_numel", [OPTIONS["min_numel"], 0])
def test_dynamic_shapes_select_whatever_size_they_were_compiled_for(min_numel):
    """A size that varies is selected whatever size the graph was compiled for (and
    whatever ``min_numel``, 0 included): compiled first for a batch below ``min_numel``, the
    graph compresses the larger batches (all of
    them once the small step has left the arena's sizing: it caps the arena for
    ``DEMAND_STEPS`` steps, so that a step like it is never worse off)."""
    model = mlp()
    compiled = torch.compile(model, backend=CompileCounterWithBackend("inductor"), dynamic=True)
    for batch in (2,) + (64,) * (DEMAND_STEPS + 1):
        x = mlp_input(batch=batch)
        expected = train_step(compiled, x, contextlib.nullcontext())
        options = {**OPTIONS, "min_numel": min_numel}
        assert_same_grads(train_step(compiled, x, bitsparse.compressing(**options)), expected)
    assert bitsparse.stats().tensors_compressed == 2


def test_eager_and_compiled_parts_in_one_model():
    model = transformer()
    stats, frames, _ = compiled_steps(model, sequence_input(), compile=lambda m, c: mixed(m, c))
    assert frames == 1
    # The compiled block's ReLU output and the eager blocks' (each stored once).
    assert [s.tensors_compressed for s in stats] == [3, 3, 3]


def mixed(model, counter):
    model[1] = torch.compile(model[1], backend=counter)
    return model


@pytest.mark.parametrize("tail_stores", [True, False], ids=["tail_stores_its_own", "tail_stores_nothing"])
def test_an_eager_relu_output_that_compiled_code_saves_is_kept_as_is_from_the_second_step(tail_stores):
    """The eager ReLU's output is the compiled tail's input, which its graph saves as it is
    (graphs hand their inputs to no hook): stored as well, it would cost its compressed size
    on top of dense. The backward shows it: alive at the tail's first restore where the tail
    stores a ReLU output of its own (stored every step), released by the tail's backward,
    before the eager ReLU's unpack, where it stores nothing."""
    torch.manual_seed(0)
    tail = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)) if tail_stores else nn.Linear(256, 10)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), tail)

    def compile_the_tail(m, counter):
        m[2] = torch.compile(m[2], backend=counter)
        return m

    stats, frames, _ = compiled_steps(model, mlp_input(), compile=compile_the_tail)
    assert frames == 1
    assert [s.tensors_compressed for s in stats] == ([2, 1, 1] if tail_stores else [1, 0, 0])
    # The eager ReLU's save of its output, kept: its site learned that storing frees nothing.
    assert stats[-1].tensors_skipped.get("unprofitable_site") == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_convnet_with_inplace_relu(dtype):
    """Exact in 16 bits too: a ReLU of a batch norm's output is stored where the graph saves
    it, not made to be saved (which changed how inductor fused the norm's statistics, and
    with them the forward's values in bf16)."""
    model, x = convnet().to(dtype), image_input().detach().to(dtype).requires_grad_()
    stats, frames, _ = compiled_steps(model, x)
    assert frames == 1
    # The partitioner keeps a one-byte mask for the first ReLU's backward (MaxPool2d saves its
    # indices) and the second ReLU's output, which is stored.
    assert [s.tensors_compressed for s in stats] == [1, 1, 1]


def _bitsparse_ops_among_kernels(code: str) -> str:
    """The order of a compiled graph's calls: ``S`` a store, ``R`` a restore, ``k`` a kernel
    inductor calls out to (a matrix product, or another op it does not generate)."""
    calls = {
        "torch.ops.bitsparse.functions.store(": "S",
        "torch.ops.bitsparse.functions.store_relu_square(": "S",
        "torch.ops.bitsparse.functions.restore_into(": "R",
        "torch.ops.bitsparse.functions.restore_relu_square_backward(": "R",
    }
    order = []
    for line in code.splitlines():
        line = line.strip()
        if line.startswith("extern_kernels.") or "torch.ops.aten." in line:
            order.append("k")
        order.extend(letter for call, letter in calls.items() if call in line)
    return "".join(order)


def _layouts(code: str) -> dict[str, tuple[tuple, tuple]]:
    """The shape and strides of each tensor that the generated ``code`` allocates (its
    ``empty_strided_cpu`` buffers) or asserts (its inputs, one by one or, from torch 2.14,
    grouped in one ``assert_size_stride_grouped``), by name."""
    layouts = {}
    for line in code.splitlines():
        line = line.strip()
        if not line.startswith(("assert_size_stride", "buf")):
            continue
        try:
            statement = ast.parse(line).body[0]
        except SyntaxError:  # the first line of a call written over several
            continue
        call = getattr(statement, "value", None)
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            continue
        if call.func.id == "empty_strided_cpu" and isinstance(statement, ast.Assign):
            layouts[statement.targets[0].id] = tuple(ast.literal_eval(a) for a in call.args[:2])
        elif call.func.id == "assert_size_stride":
            layouts[call.args[0].id] = tuple(ast.literal_eval(a) for a in call.args[1:3])
        elif call.func.id == "assert_size_stride_grouped":
            names = [name.id for name in call.args[0].elts]
            layouts.update(zip(names, zip(ast.literal_eval(call.args[1]), ast.literal_eval(call.args[2]))))
    return layouts


def _generated_code(fn) -> list[str]:
    """The code inductor generates while ``fn`` runs."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        fn()
    return codes


@pytest.mark.parametrize("hidden, stored", [(400, 0), (448, 1)])
def test_a_tensor_inductor_pads_is_kept_in_the_layout_the_backward_reads(hidden, stored):
    """Inductor pads the rows of a buffer whose layout it chooses (its comprehensive padding,
    on GPUs: rows longer than ``padding_stride_threshold`` elements rounded up to 128 bytes;
    turned on here for the CPU, with a lower threshold). A restore's buffer takes its strides
    before inductor lays the forward out, so a ReLU output of 400 float32 elements a row,
    padded to 416, is kept as the graph saves it, and one of 448, a multiple of 32, is stored:
    either way the backward reads the layout it reads without BitSparse."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, 64, bias=False))
    with torch._inductor.config.patch(disable_padding_cpu=False, padding_stride_threshold=64):
        runs = []
        codes = _generated_code(lambda: runs.append(compiled_steps(model, torch.randn(256, 64), steps=2)))
    ((stats, frames, _),) = runs
    assert frames == 1 and [s.tensors_compressed for s in stats] == [stored, stored]
    _, dense_backward, _, backward = codes

    def relu_row_stride(code: str) -> int:
        """The row stride of the ReLU output the backward reads: the saved tensor's, or that
        of the buffer it is restored into."""
        layouts = _layouts(code)
        (buffer,) = re.findall(r"bitsparse\.functions\.restore_into\(\w+, (\w+)\)", code) or [
            name for name in layouts if name.startswith("relu")
        ]
        shape, (stride, column) = layouts[buffer]
        assert shape == (256, hidden) and column == 1
        return stride

    assert relu_row_stride(backward) == relu_row_stride(dense_backward) == (hidden if stored else 416)


class CheckpointedMLP(nn.Module):
    """``mlp()`` run under ``torch.utils.checkpoint``, with a selective policy that saves
    ReLU outputs if ``save_relus``."""

    def __init__(self, save_relus: bool):
        super().__init__()
        self.layers, self.save_relus = mlp(), save_relus

    def forward(self, x):
        def policy(ctx, op, *args, **kwargs):
            relu = op is torch.ops.aten.relu.default
            return CheckpointPolicy.MUST_SAVE if relu else CheckpointPolicy.PREFER_RECOMPUTE

        context = functools.partial(create_selective_checkpoint_contexts, policy)
        if self.save_relus:
            return checkpoint(self.layers, x, use_reentrant=False, context_fn=context)
        return checkpoint(self.layers, x, use_reentrant=False)


@pytest.mark.parametrize("save_relus, stored", [(False, 0), (True, 2)], ids=["checkpoint", "relus_saved"])
def test_a_checkpointed_region_keeps_the_users_plan(save_relus, stored):
    """Compiled, the partitioner recomputes what the user checkpoints; BitSparse, which tags
    ReLU outputs to be saved where they are its to compress, leaves a checkpointed region's
    tags as they are: nothing of it is saved, as without BitSparse. Where the user's policy
    saves the ReLU outputs, they are stored."""
    stats, frames, _ = compiled_steps(CheckpointedMLP(save_relus), mlp_input())
    assert frames == 1 and [(s.tensors_seen, s.tensors_compressed) for s in stats] == [(stored, stored)] * 3


def test_a_memory_budget_keeps_the_partitioners_plan():
    """With a memory budget (``activation_memory_budget`` below 1) the partitioner recomputes
    what it chooses to fit the budget; BitSparse tags nothing, and stores only the ReLU-family
    tensors the graph saves without it (here none)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[ReLUSquareMLP(True, dim=64, hidden=256) for _ in range(3)])
    with torch._functorch.config.patch(activation_memory_budget=0.3):
        stats, frames, _ = compiled_steps(model, mlp_input(batch=512, d_in=64))
    assert frames == 1 and [(s.tensors_seen, s.tensors_compressed) for s in stats] == [(0, 0)] * 3


class ReturnsFirstHidden(nn.Module):
    """``mlp()`` that also returns its first ReLU output."""

    def __init__(self):
        super().__init__()
        self.layers = mlp()

    def forward(self, x):
        first = self.layers[1](self.layers[0](x))
        return self.layers[2:](first), first


class FirstOutput(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)[0]


def test_a_tensor_the_forward_also_returns_is_not_stored():
    """With hooks on every tensor a graph saves (AOTAutograd's default filter hands them none
    that an output shares), a ReLU output that the forward returns as well is kept as it is:
    its caller holds it anyway. The other one is stored."""
    with torch._functorch.config.patch(saved_tensors_hooks_filtering_mode="all"):
        stats, frames, _ = compiled_steps(
            ReturnsFirstHidden(), mlp_input(), compile=lambda m, counter: FirstOutput(torch.compile(m, backend=counter))
        )
    assert frames == 1 and [s.tensors_compressed for s in stats] == [1, 1, 1]


@pytest.mark.parametrize("steered_by", ["block", "compile_callbacks"])
def test_compiled_stores_follow_their_tensors_and_restores_precede_their_uses(steered_by):
    """The forward stores each ReLU output as its layer computes it (AOTAutograd traces the
    packs at its end, where inductor would compute each ReLU again from its input, kept alive
    until then), and the backward decodes each one where it is first needed (not all of them
    at its start). The compile is steered by the block (its first after Dynamo's reset) or,
    in every later block, only by Dynamo's compile callbacks, with nothing set per block."""
    import torch._functorch.config as functorch_config

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=3, dim=32, heads=2, head_dim=16, hidden=128, vocab=64))
    tokens = torch.randint(64, (1, 64))
    compiled = torch.compile(model, fullgraph=True)
    joint_pass = functorch_config.joint_custom_pass
    if steered_by == "compile_callbacks":
        with bitsparse.compressing(min_numel=1024):
            pass  # registers them
    with bitsparse.compressing(min_numel=1024):
        assert (functorch_config.joint_custom_pass is joint_pass) == (steered_by == "compile_callbacks")
        codes = _generated_code(lambda: compiled(tokens, tokens))
    assert functorch_config.joint_custom_pass is joint_pass
    forward, backward = (_bitsparse_ops_among_kernels(code) for code in codes)  # both compiled in the forward
    assert forward.count("S") == 3 and "SS" not in forward, forward
    assert backward.count("R") == 3 and "RR" not in backward and not backward.startswith("R"), backward


@pytest.mark.usefixtures("fused_backwards_on_the_cpu")
@pytest.mark.parametrize("relu_squares", [False, True], ids=["mlp", "relu_squares"])
def test_compiled_arena_that_is_full_stays_exact(relu_squares):
    """Kept dense where the arena has no room (a ReLU output that the forward squares as its
    input, and restored as its ReLU, or into its square and its input's gradient: the blocks'
    ``fc`` without biases), exact; the arena grows."""
    model, x = (transformer(), sequence_input()) if relu_squares else (mlp(), mlp_input())
    for block in model[:3] if relu_squares else ():
        block.fc.bias = None
    steps = []
    codes = _generated_code(lambda: steps.append(compiled_steps(model, x, capacity=4096)))
    ((stats, _, _),) = steps
    fused = sum(code.count("bitsparse.functions.restore_relu_square_backward(") for code in codes)
    assert fused == (3 if relu_squares else 0)  # one per block
    assert stats[0].fallbacks.get("arena_full", 0) > 0
    assert stats[-1].fallbacks == {} and stats[-1].tensors_compressed == (3 if relu_squares else 2)


def test_retain_graph_through_a_compiled_model():
    """The backward is compiled with the forward, reusing the saved buffers, and PyTorch
    refuses ``retain_graph=True`` through it unless ``donated_buffer`` is off, as its error
    says: then both backwards give the gradients of one backward without BitSparse, exactly
    (the second decodes again). Compared with the first backward only: without BitSparse,
    torch 2.14.1's second backward through this graph gave other gradients on the CPU."""
    model, x = mlp(), mlp_input()
    compiled = torch.compile(model, backend="inductor")
    inputs = [x, *model.parameters()]

    def two_backwards(ctx):
        with ctx:
            loss = compiled(x).square().sum()
        first = torch.autograd.grad(loss, inputs, retain_graph=True)
        return first, torch.autograd.grad(loss, inputs)

    with torch._functorch.config.patch(donated_buffer=False):
        expected, _ = two_backwards(contextlib.nullcontext())
        for _ in range(2):
            first, second = two_backwards(bitsparse.compressing(**OPTIONS))
            assert_same_grads(first, expected)
            assert_same_grads(second, expected)
            assert bitsparse.stats().tensors_compressed == 2


def _compiler_settings() -> tuple:
    """What BitSparse sets for a compile and restores after it: inductor's settings, and the
    scheduler's method it mends before PyTorch 2.14."""
    import torch._inductor.config as config
    from torch._inductor.scheduler import SchedulerNode

    return (
        config.allow_buffer_reuse,
        config.inplace_buffers,
        config.post_grad_custom_post_pass,
        SchedulerNode.recompute_size_and_body,
    )


def _pooled_paths(x: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient flows through a max pooling beside other paths: compiled by
    PyTorch 2.13 on the CPU, its backward loses the pooling's part."""
    product = x * torch.relu(x)
    tail = nn.functional.leaky_relu(x.clone().relu_()[:, 1:], 0.01)
    weight = torch.full((4, 4, 3, 3), 1 / 36)
    conv = nn.functional.conv2d(product.reshape(48, 4, 5, 5), weight, padding=1)
    pooled = nn.functional.max_pool2d(torch.relu(conv), 2)
    return sum(t.square().mean() for t in (x, product, tail, pooled, torch.sigmoid(tail)))


def test_compiled_gradients_are_right_where_the_scheduler_before_pytorch_2_14_is_wrong():
    """Before PyTorch 2.14 inductor's CPU scheduler could run a kernel before an op that writes
    what it reads in place (here max pooling's backward, which scatters into a buffer of
    zeros; pytorch/pytorch#185509). BitSparse mends it for its compiles, whose restores write
    in place: under ``compressing()`` the compiled gradients are eager's, to float32
    rounding, where without BitSparse PyTorch 2.13 loses the pooling's part."""
    x = (torch.randn(48, 100, generator=generator(17)) - 1).requires_grad_()
    (expected,) = torch.autograd.grad(_pooled_paths(x), x)
    compiled = torch.compile(_pooled_paths)
    with bitsparse.compressing(**OPTIONS):
        loss = compiled(x)
    (got,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-8)


def test_a_dynamo_reset_inside_a_block_leaves_its_compile_exact():
    """``torch._dynamo.reset()`` removes the compile callbacks that steer compiles: a compile
    after it in the same block is steered late (the stores placed after their tensors), the
    tensors a full arena keeps dense stay exact, and the settings are restored when it ends."""
    settings = _compiler_settings()
    options = {**OPTIONS, "capacity": 4096}
    with bitsparse.compressing(**options):
        pass  # registers the compile callbacks
    model, x = mlp(), mlp_input()
    compiled = torch.compile(model)
    expected = train_step(compiled, x, contextlib.nullcontext())

    codes = []

    @contextlib.contextmanager
    def reset_inside():
        with bitsparse.compressing(**options):
            torch._dynamo.reset()
            codes.extend(_generated_code(lambda: compiled(x)))  # compiled here
            yield

    assert_same_grads(train_step(compiled, x, reset_inside()), expected)
    assert bitsparse.stats().fallbacks.get("arena_full", 0) > 0
    forward = _bitsparse_ops_among_kernels(codes[0])
    assert forward.count("S") == 2 and "SS" not in forward, forward
    assert _compiler_settings() == settings


def test_first_compiled_step_with_an_arena_that_follows_demand():
    stats, _, _ = compiled_steps(mlp(), mlp_input(), capacity="auto")
    assert stats[0].tensors_compressed == 0 and stats[0].fallbacks == {"arena_full": 2}
    assert [s.tensors_compressed for s in stats[1:]] == [2, 2]


def test_options_compile_once_per_selection_and_never_for_run_time_options():
    """Compiled graphs depend on what is selected (``min_numel``, ``select``), not on how it is
    stored: changing only the rest compiles nothing again, and the graphs store with the
    options of the block that runs them (here ``sign_pack``, which stores fewer bytes)."""
    model, x = mlp(), mlp_input()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    expected = train_step(compiled, x, contextlib.nullcontext())
    run_time = [{}, {"sign_pack": True}, {"capacity": 2 * ARENA}, {"window": None}, {"host_spill": False}, {}]
    selecting = [{"min_numel": 2048}, {"min_numel": 2048, "sign_pack": True}, {}]
    frames, stored = [], []
    for options in run_time + selecting:
        assert_same_grads(train_step(compiled, x, bitsparse.compressing(**{**OPTIONS, **options})), expected)
        s = bitsparse.stats()
        assert s.tensors_compressed == 2
        frames.append(counter.frame_count)
        stored.append(s.stored_bytes)
    assert frames == [2] * len(run_time) + [3, 3, 3]  # one compile per selection, then none
    assert stored[1] < stored[0] and stored[7] < stored[6]
    train_step(compiled, x, contextlib.nullcontext())  # and none when leaving BitSparse
    assert counter.frame_count == 3


def test_select_all_learns_and_compiles_once_more_without_the_sites_that_do_not_pay():
    """Exact from the first step: the convolutions' outputs and what follows them, which
    inductor lays out channels-last in this graph where eager's strides are contiguous, are
    stored and restored in that layout, as the graph without BitSparse saves them (in eager's
    layout, the backward's kernels reduced in another order)."""
    model, x = convnet(), image_input()
    stats, frames, _ = compiled_steps(model, x, steps=4, select="all")
    assert stats[0].tensors_seen > stats[-1].tensors_seen == stats[-1].tensors_compressed == 1
    assert frames == 2


class CompiledReLU(torch.autograd.Function):
    """A custom Function whose forward saves a ReLU output: traced by the compiled graph."""

    @staticmethod
    def forward(ctx, x):
        y = torch.relu(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (y > 0)


class FusedLinearReLUSquare(torch.autograd.Function):
    """In the style of Modded-NanoGPT's fused MLP: the forward saves the squared output itself,
    which the author marks (no ReLU op is left for the rule to see)."""

    @staticmethod
    def forward(ctx, x, w1, w2):
        pre = x @ w1
        post = bitsparse.mark(torch.where(pre > 0, pre, 0.0) ** 2)
        ctx.save_for_backward(x, w1, w2, pre, post)
        return post @ w2

    @staticmethod
    def backward(ctx, grad):
        x, w1, w2, pre, post = ctx.saved_tensors
        grad_post = grad @ w2.t()
        grad_pre = grad_post * 2 * torch.where(pre > 0, pre, 0.0)
        return grad_pre @ w1.t(), x.t() @ grad_pre, post.t() @ grad


@pytest.mark.parametrize("function", ["relu", "fused_marked"])
def test_custom_function_traced_by_a_compiled_graph(function):
    torch.manual_seed(0)
    lin = nn.Linear(32, 256)
    w1, w2 = nn.Parameter(torch.randn(32, 256) / 8), nn.Parameter(torch.randn(256, 10) / 16)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.w1, self.w2 = lin, w1, w2

        def forward(self, x):
            if function == "relu":
                return CompiledReLU.apply(self.lin(x)) @ self.w2
            return FusedLinearReLUSquare.apply(x, self.w1, self.w2)

    stats, frames, _ = compiled_steps(Model(), mlp_input(), compile=fullgraph)
    assert frames == 1
    assert [s.tensors_compressed for s in stats] == [1, 1, 1]


def test_marked_tensor_in_eager_mode_is_the_tensor_itself():
    model, x = CustomMLP(use_mark=True), mlp_input()
    for _ in range(2):
        train_step(model, x, bitsparse.compressing(**OPTIONS))
        assert bitsparse.stats().tensors_compressed == 1


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graphs_are_refused_with_the_alternative(mode):
    compiled = torch.compile(mlp(), mode=mode)
    with pytest.raises(Exception, match=rf"does not support CUDA graphs.*'{mode}'.*max-autotune-no-cudagraphs"):
        train_step(compiled, mlp_input(), bitsparse.compressing(**OPTIONS))
    assert alive() == 0
    # The library still works afterwards.
    stats, _, _ = compiled_steps(mlp(), mlp_input())
    assert stats[-1].tensors_compressed == 2


def test_graphs_compiled_under_bitsparse_reuse_buffers():
    """Compiled code reuses buffers and computes in place under BitSparse's hooks as without
    them, and the compiler's settings are as they were after the compile."""
    settings = _compiler_settings()
    compiled = torch.compile(mlp())
    plain = _generated_code(lambda: compiled(mlp_input()))
    torch._dynamo.reset()
    with bitsparse.compressing(**OPTIONS):
        steered = _generated_code(lambda: compiled(mlp_input()))
    assert "bitsparse.functions.store" in steered[0]
    assert "# reuse" in plain[0] and "# reuse" in steered[0]
    assert _compiler_settings() == settings


@pytest.mark.usefixtures("reporting_arenas", "fused_backwards_on_the_cpu")
@pytest.mark.parametrize("relu_squares", [False, True], ids=["relus", "relu_squares"])
def test_held_tensors_of_a_compiled_graph_are_copies(monkeypatch, relu_squares):
    """With the GPU three appends behind the host and no spill region, the arena is not sure
    of every store: those tensors are held until their reports come, as copies, since the
    graph writes over their buffers past the store (reused, or computed in place), and the
    gradients stay those of the compiled model without BitSparse, bit for bit."""
    LaggingDevice(monkeypatch, lag=3)
    copies = []
    keep_copy = handles.StoredTensor.keep_copy
    monkeypatch.setattr(handles.StoredTensor, "keep_copy", lambda handle: copies.append(keep_copy(handle)))
    torch.manual_seed(0)
    layers = [layer for _ in range(6) for layer in (nn.Linear(64, 64), nn.ReLU())]
    model = (ReLUSquares if relu_squares else nn.Sequential)(*layers)
    stats, frames, _ = compiled_steps(model, torch.randn(64, 64), steps=3, capacity="auto", host_spill=False)
    stored = stats[0].fallbacks["arena_full"]  # the first step only measures: all kept
    assert frames == 1 and stored >= 5 and stats[0].tensors_compressed == 0
    assert all(s.tensors_compressed == stored and s.fallbacks == {} for s in stats[1:])
    assert len(copies) > stored + 2  # the first step's kept tensors, and some held in each step after


class ReLUSquares(nn.Sequential):
    """Linear and ReLU layers, each ReLU output squared before the next layer (fused stores)."""

    def forward(self, x):
        for layer in self:
            x = layer(x) ** 2 if isinstance(layer, nn.ReLU) else layer(x)
        return x


_COMPILE_INSIDE = """
import sys, torch, torch.nn as nn, bitsparse
assert "torch._inductor" not in sys.modules
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
x = torch.randn(64, 32)
with bitsparse.compressing(min_numel=1024, capacity=1 << 20):
    loss = torch.compile(model)(x).sum()  # inductor is loaded here, inside the block
    import torch._inductor.config as config
    assert config.post_grad_custom_post_pass is not None
loss.backward()
assert config.post_grad_custom_post_pass is None
assert bitsparse.stats().tensors_compressed == 1, bitsparse.stats()
print("OK")
"""


def test_a_compile_that_loads_inductor_inside_the_block_is_steered_too():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _COMPILE_INSIDE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr


def test_max_autotune_without_cuda_graphs():
    stats, _, _ = compiled_steps(
        mlp(), mlp_input(), compile=lambda m, c: torch.compile(m, mode="max-autotune-no-cudagraphs")
    )
    assert [s.tensors_compressed for s in stats] == [2, 2, 2]


class ReLUSquared(nn.Module):
    """``down(relu(x) ** 2)`` on its input, so that a test chooses the ReLU's input bits."""

    def __init__(self, d=128):
        super().__init__()
        torch.manual_seed(0)
        self.down = nn.Linear(d, 8)

    def forward(self, x):
        return self.down(torch.relu(x) ** 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_fused_relu_square_of_edge_values_gives_the_gradients_of_the_graph_without_it(dtype):
    """-0.0, subnormals of both signs, squares that underflow or overflow, infinities and a
    NaN in the ReLU's input: the gradients (the input's too, which the restored ReLU output
    gives directly) are those of the same compiled model without BitSparse, bit for bit."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    tiny = torch.finfo(dtype).tiny
    edges = [-0.0, tiny / 4, -tiny / 4, 1e-30, -1e-30, 1e30, -1e30, -float("inf"), float("inf"), float("nan")]
    x[:4, : len(edges)] = torch.tensor(edges, dtype=dtype)
    x[4:, :] = x[4:, :].clamp(-1e4, 1e4)  # the rows below the edges stay finite
    model = ReLUSquared().to(dtype)
    stats, frames, _ = compiled_steps(model, x.requires_grad_())
    assert frames == 1 and [s.tensors_compressed for s in stats] == [1, 1, 1]


def test_a_fused_relu_square_whose_site_does_not_pay_is_kept_and_squared():
    """A ReLU that zeroes nothing does not pay: under ``enable()``, whose hooks (and so the
    compiled graph) stay, it is kept as its input and restored as its ReLU, with its square
    still written, exactly."""
    x = (torch.rand(64, 128, generator=torch.Generator().manual_seed(4)) + 0.5).requires_grad_()
    model = ReLUSquared()
    compiled = torch.compile(model)
    expected = train_step(compiled, x, contextlib.nullcontext())
    bitsparse.enable(**OPTIONS)
    try:
        for step in range(3):
            assert_same_grads(train_step(compiled, x, contextlib.nullcontext()), expected)
            stats = bitsparse.stats()  # the loss's own saved tensor is small
            assert stats.tensors_skipped == {"small": 1, **({"unprofitable_site": 1} if step else {})}, str(stats)
            assert stats.tensors_compressed == (step == 0) and stats.fallbacks == {}
    finally:
        bitsparse.disable()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_the_codecs_relu_and_its_square_are_those_of_compiled_code(dtype):
    """What a fused store writes (the square) is what inductor's code computes for ``relu(x)
    ** 2``, and what it restores (the ReLU) what inductor's ReLU writes, for every bit pattern
    of the 16-bit dtypes and a spread of float32's (NaN payloads, subnormals, rounding
    cases). A NaN is restored as it was given: compiled code quiets some when it writes a
    ReLU out, which the graph without BitSparse never does (its backward computes the ReLU
    from the same input bits, in float32)."""
    from bitsparse.hooks.exactness import probe

    x = probe(dtype, torch.device("cpu"))
    relu, square = torch.compile(lambda x: (torch.relu(x), torch.relu(x) ** 2))(x)
    stored, fused = compress_relu_of(x, "torch")
    assert_bitwise_equal(fused, square)
    restored = bitsparse.decompress(stored)
    nan = torch.isnan(x)
    assert_bitwise_equal(restored[~nan], relu[~nan])
    assert_bitwise_equal(restored[nan], x[nan])


@pytest.mark.usefixtures("fused_backwards_on_the_cpu")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_a_fused_relu_square_backward_gives_the_gradients_of_the_graph_without_it(dtype):
    """The backward of ``relu(x) ** 2`` restored as its square and its input's gradient in one
    op (``fuse_relu_square_backwards``): see ``check_fused_relu_square_backward``."""
    check_fused_relu_square_backward(dtype, torch.device("cpu"))


class ReLUSquareMLP(nn.Module):
    """``proj(relu(fc(x)) ** 2)``, both with biases or without, its square also summed if
    ``square_summed``, a parameter added to ``fc(x)`` if ``shifted``."""

    def __init__(self, bias: bool, square_summed=False, shifted=False, dim: int = 64, hidden: int = 256):
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, hidden, bias=bias), nn.Linear(hidden, dim, bias=bias)
        self.shift = nn.Parameter(torch.randn(hidden) / 8) if shifted else None
        self.square_summed = square_summed

    def forward(self, x):
        square = torch.relu(self.fc(x) if self.shift is None else self.fc(x) + self.shift) ** 2
        return self.proj(square) + (square.sum(-1, keepdim=True) if self.square_summed else 0)


@pytest.mark.usefixtures("fused_backwards_on_the_cpu")
@pytest.mark.parametrize("square_summed, shifted", [(True, False), (False, True)], ids=["square_summed", "shifted"])
def test_a_16_bit_layer_keeps_the_roundings_of_the_graph_without_bitsparse(square_summed, shifted):
    """Inductor rounds a 16-bit tensor where it writes it into memory: a tensor the graph
    saves, as it makes it; a tensor only used within the graph, in each kernel that reads it
    from memory, while a kernel it fuses the producer into sees float32. Here, with BitSparse
    steering the partitioner as it does for ``proj(relu(fc(x)) ** 2)``, a square that the
    forward also sums would be summed unrounded, and ``fc(x) + shift`` would become one matrix
    product with the shift added before rounding (a pattern inductor applies to a product
    that nothing else uses): the graph saves what it saves without BitSparse where steering
    could change a rounding, and a stored tensor is written to memory as a saved one is
    (gradients bit-identical in ``compiled_steps``)."""
    torch.manual_seed(0)
    model = ReLUSquareMLP(False, square_summed, shifted, dim=256, hidden=1024).to(torch.bfloat16)
    compiled_steps(model, torch.randn(128, 256, dtype=torch.bfloat16))


@pytest.mark.usefixtures("fused_backwards_on_the_cpu")
@pytest.mark.parametrize(
    "bias, square_summed, stored, fused",
    [(False, False, 1, (1, 1)), (True, False, 1, (1, 0)), (False, True, 2, (0, 0))],
    ids=["no_bias", "bias", "square_summed"],
)
def test_a_16_bit_square_and_gradient_are_fused_only_where_matrix_products_read_them(
    bias, square_summed, stored, fused
):
    """In 16 bits, the forward writes the square, and the backward the square and the ReLU
    input's gradient, in BitSparse's ops only where nothing but matrix products read them:
    inductor computes a consumer it fuses with their producer (the bias's gradient, a sum of
    the input's gradient; a sum of the square) from values not yet rounded to 16 bits, which
    the ops cannot give it (``graph_passes.only_read_from_memory``). A square also summed is saved, as in
    the graph without BitSparse, and stored beside the ReLU output. Gradients exact in each
    case."""
    torch.manual_seed(0)
    model = ReLUSquareMLP(bias, square_summed).to(torch.bfloat16)
    x = torch.randn(128, 64, dtype=torch.bfloat16)
    steps = []
    codes = _generated_code(lambda: steps.append(compiled_steps(model, x)))
    ((stats, _, _),) = steps
    assert [s.tensors_compressed for s in stats] == [stored] * 3
    (forward,) = [code for code in codes if "bitsparse.functions.store" in code]
    (backward,) = [code for code in codes if "bitsparse.functions.restore" in code]
    assert forward.count("bitsparse.functions.store_relu_square(") == fused[0]
    assert backward.count("bitsparse.functions.restore_relu_square_backward(") == fused[1]


def check_fused_relu_square_backward(dtype: torch.dtype, device: torch.device) -> None:
    """For every bit pattern of the 16-bit dtypes (a spread of float32's) in ``x``, squared
    into a matrix product as a ReLU^2 MLP does, the gradients are those of the same compiled
    function without BitSparse, bit for bit. The square's gradient is a product of random
    matrices, infinite in two of its columns and NaN in a third (not on the CPU, see
    ``FUSED_BACKWARD_DEVICES``). The backward uses the square (for ``weight``'s gradient)
    before it has the square's gradient: the fused op and what needs it follow that use."""
    from bitsparse.hooks.exactness import probe

    x = probe(dtype, device).view(256, 256)
    random = generator("relu_square_backward", dtype)
    weight = torch.randn(256, 256, generator=random).to(dtype).to(device)
    scale = (torch.randn(256, 256, generator=random).abs() + 0.5).to(dtype).to(device)  # no inf - inf
    weight[0], weight[1] = float("inf"), -float("inf")
    if device.type != "cpu":
        weight[2] = float("nan")

    def loss(x, weight, scale):
        return ((torch.relu(x) ** 2 @ weight) * scale).float().sum()

    compiled = torch.compile(loss)
    expected = _input_grads(compiled, x, weight, scale, context=contextlib.nullcontext())
    codes = _generated_code(
        lambda: _input_grads(compiled, x, weight, scale, context=bitsparse.compressing(**OPTIONS))
    )
    assert sum(code.count("torch.ops.bitsparse.functions.restore_relu_square_backward(") for code in codes) == 1
    for _ in range(2):
        got = _input_grads(compiled, x, weight, scale, context=bitsparse.compressing(**OPTIONS))
        for a, b in zip(got, expected):
            assert_bitwise_equal(a, b)
    assert bitsparse.stats().tensors_compressed == 1


def _input_grads(fn, *inputs, context):
    inputs = [t.detach().requires_grad_() for t in inputs]
    with context:
        out = fn(*inputs)
    out.backward()
    return [t.grad for t in inputs]
