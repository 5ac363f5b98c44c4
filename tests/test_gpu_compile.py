"""BitSparse inside ``torch.compile`` on CUDA: bf16 gradients bit-identical to the same compiled
model without it, no host synchronization in a compiled step, and no step above dense."""

import pytest
import torch
from test_gpu_hooks import _step_peaks, relu_product, small_gpt, step_without_host_synchronization

import bitsparse
from bitsparse.bench.training import deterministic_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    bitsparse.reset()
    with deterministic_kernels():
        yield
    bitsparse.disable()
    torch._dynamo.reset()


def compiled_gpt(scope: str, zeros=0.9):
    model, loss_fn = small_gpt(zeros)
    if scope == "model":
        return model, torch.compile(loss_fn)
    for block in model.blocks:
        block.compile()
    return model, loss_fn


def grads(model, loss_fn, context):
    model.zero_grad(set_to_none=True)
    with context:
        loss = loss_fn()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("scope", ["model", "block"])
@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_compiled_gpt_bf16_gradients_are_bit_identical(scope, sign_pack):
    model, loss_fn = compiled_gpt(scope)
    reference = grads(model, loss_fn, torch.enable_grad())
    assert all(torch.equal(a, b) for a, b in zip(reference, grads(model, loss_fn, torch.enable_grad()))), (
        "compiled dense runs disagree: a nondeterministic kernel, not BitSparse"
    )
    for _ in range(3):
        got = grads(model, loss_fn, bitsparse.compressing(min_numel=1024, sign_pack=sign_pack))
        assert all(torch.equal(a, b) for a, b in zip(reference, got))
    stats = bitsparse.stats()
    assert stats.tensors_compressed == 3 and stats.fallbacks == {}, str(stats)


@pytest.mark.parametrize("after", ["dropout", "reglu", "relu2_glu"])
def test_compiled_products_that_keep_a_relus_zeros_stay_exact(after):
    """Compiled, dropout's output (``relu * mask * scale``) is what the graph saves, and is
    stored; a ReGLU's (and a ReLU²-GLU's) graph saves the ReLU output, stored, and computes
    the product (and the square) again."""
    model, loss_fn = relu_product(after)
    model.compile()
    reference = grads(model, loss_fn, torch.enable_grad())
    assert all(torch.equal(a, b) for a, b in zip(reference, grads(model, loss_fn, torch.enable_grad())))
    for _ in range(3):
        got = grads(model, loss_fn, bitsparse.compressing(min_numel=1024))
        assert all(torch.equal(a, b) for a, b in zip(reference, got))
    stats = bitsparse.stats()
    assert (stats.tensors_compressed, stats.fallbacks) == (1, {}), str(stats)


def test_compiled_gpt_stores_each_relu_output_where_it_squares_it():
    """The GPT's ``fc(x).relu_().square()`` compiles to one op per layer that stores the ReLU
    output and writes its square (``fuse_relu_squares``): three for the whole model, one in
    the block that every layer runs when each is compiled alone. Its ``fc`` has a bias, whose
    gradient inductor sums from unrounded values: the backward restores the ReLU output
    (``fuse_relu_square_backwards`` leaves it)."""
    from test_compile import _generated_code

    for scope, fused in (("model", 3), ("block", 1)):
        torch._dynamo.reset()
        _, loss_fn = compiled_gpt(scope)
        with bitsparse.compressing(min_numel=1024):
            code = "".join(_generated_code(lambda: loss_fn().backward()))
        assert code.count("torch.ops.bitsparse.functions.store_relu_square(") == fused, scope
        assert code.count("torch.ops.bitsparse.functions.restore_into(") == fused, scope
        assert "torch.ops.bitsparse.functions.store(" not in code, scope
        assert "torch.ops.bitsparse.functions.restore_relu_square_backward(" not in code, scope


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_a_relu_square_layer_has_the_gradients_of_the_graph_without_it(bias):
    """A bf16 ``proj(relu(fc(x)) ** 2)`` whose backward inductor compiles into a kernel that
    sums ``fc``'s bias gradient from the gradient before its rounding to bf16 (at this size):
    bit-identical gradients, with the backward fused where ``fc`` has no bias."""
    from test_compile import ReLUSquareMLP, _generated_code, compiled_steps

    torch.manual_seed(0)
    model = ReLUSquareMLP(bias, dim=256, hidden=1024).cuda().to(torch.bfloat16)
    if bias:
        with torch.no_grad():
            model.fc.bias -= 1.0
    x = torch.randn(1, 128, 256, device="cuda", dtype=torch.bfloat16)
    steps = []
    codes = _generated_code(lambda: steps.append(compiled_steps(model, x, min_numel=1024)))
    ((stats, _, _),) = steps
    assert [s.tensors_compressed for s in stats] == [1, 1, 1]
    fused = sum(code.count("bitsparse.functions.restore_relu_square_backward(") for code in codes)
    assert fused == (0 if bias else 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("square_summed, shifted", [(True, False), (False, True)], ids=["square_summed", "shifted"])
def test_a_layer_keeps_the_roundings_of_the_graph_without_bitsparse(square_summed, shifted, dtype):
    """test_compile's ``test_a_16_bit_layer_keeps_the_roundings_of_the_graph_without_bitsparse``
    with CUDA's kernels, in float32 too: a reduction that inductor fuses with its input's
    producer may sum in another order than one that reads the input from memory (a float32
    square that the forward also sums, recomputed in the backward where the graph without
    BitSparse saves it, gave other gradients)."""
    from test_compile import ReLUSquareMLP, compiled_steps

    torch.manual_seed(0)
    model = ReLUSquareMLP(False, square_summed, shifted, dim=256, hidden=1024).cuda().to(dtype)
    compiled_steps(model, torch.randn(512, 256, device="cuda", dtype=dtype), min_numel=1024)


@pytest.mark.parametrize("hidden, stored", [(4000, 0), (4032, 1)])
def test_a_layer_whose_rows_inductor_pads_keeps_its_gradients(hidden, stored):
    """test_compile's ``test_a_tensor_inductor_pads_is_kept_in_the_layout_the_backward_reads``
    with CUDA's own padding: the ReLU output of a bf16 layer of 4000 hidden units (rows that
    inductor pads to 4032 elements) is kept as the graph saves it; restored with unpadded
    strides, its biased layer's gradients differed. A layer of 4032 units is stored."""
    from test_compile import ReLUSquareMLP, compiled_steps

    torch.manual_seed(0)
    model = ReLUSquareMLP(True, dim=1000, hidden=hidden).cuda().to(torch.bfloat16)
    with torch.no_grad():
        model.fc.bias -= 1.0  # mostly zeros
    stats, _, _ = compiled_steps(model, torch.randn(512, 1000, device="cuda", dtype=torch.bfloat16), min_numel=1024)
    assert [s.tensors_compressed for s in stats] == [stored] * 3


def test_dynamic_shapes_compile_once_for_every_length():
    """test_compile's test of the same name, in bf16 on CUDA."""
    from test_compile import check_dynamic_shapes

    check_dynamic_shapes(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_a_fused_relu_square_backward_gives_the_gradients_of_the_graph_without_it(dtype):
    """The decoder's square and gradient are inductor's, for every pattern of the 16-bit
    dtypes in the ReLU's input and random bits in the square's gradient, NaNs included."""
    from test_compile import check_fused_relu_square_backward

    check_fused_relu_square_backward(dtype, torch.device("cuda"))


def test_compiled_step_has_no_host_synchronization():
    model, loss_fn = compiled_gpt("model")
    for _ in range(3):  # compile, and let the arena settle
        grads(model, loss_fn, bitsparse.compressing(min_numel=1024))
    step_without_host_synchronization(loss_fn)
    assert bitsparse.stats().tensors_compressed == 3


def test_no_compiled_step_peaks_above_compiled_dense():
    model, loss_fn = compiled_gpt("model", zeros=None)
    dense = _step_peaks(model, loss_fn, torch.enable_grad, 3)
    peaks = _step_peaks(model, loss_fn, lambda: bitsparse.compressing(min_numel=1024), 4)
    assert bitsparse.stats().tensors_compressed == 3
    # The first step keeps a copy of each tensor it measures (the compiled graph reuses the
    # memory it was in), and saves no square: it measures (in host memory), no higher than dense.
    assert peaks[0] <= dense[2], (peaks, dense)
    assert all(peak < dense[2] for peak in peaks[1:]), (peaks, dense)


def test_an_eager_relu_output_that_compiled_code_saves_costs_no_step_more_than_dense():
    """The ReLU runs eagerly and a compiled layer saves its output as an input (compiled code
    hands its inputs to no hook): storing it frees nothing, which the first step shows when
    the layer's backward, on the device's autograd thread, lets it go; it is never stored."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
    model = model.to("cuda", torch.bfloat16)
    model[2] = torch.compile(model[2])
    x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)

    def loss_fn():
        return model(x).float().square().mean()

    dense = _step_peaks(model, loss_fn, torch.enable_grad, 3)
    peaks = _step_peaks(model, loss_fn, bitsparse.compressing, 4)
    stats = bitsparse.stats()
    assert stats.tensors_compressed == 0 and stats.tensors_skipped.get("unprofitable_site") == 1, str(stats)
    assert all(peak <= dense[2] for peak in peaks), (peaks, dense)
