"""The training hooks on CUDA: exact bf16 gradients and no host synchronization."""

import pytest
import torch

import bitsparse
from bitsparse.bench.models import GPT, GPTConfig, MLPStack, shift_to_sparsity
from bitsparse.bench.pipeline import one_f_one_b, run_iteration
from bitsparse.bench.training import compare_modes, deterministic_kernels, max_memory_allocated

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def deterministic():
    """Bit-exact comparisons need deterministic kernels (embedding backward, cuBLAS)."""
    with deterministic_kernels():
        yield
    bitsparse.disable()


def grads_of(model, loss_fn, **options):
    model.zero_grad(set_to_none=True)
    with bitsparse.compressing(**options):
        loss = loss_fn()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def small_gpt(zeros):
    torch.manual_seed(0)
    config = GPTConfig(layers=3, dim=256, heads=2, head_dim=128, hidden=1024, vocab=4096)
    model = GPT(config).cuda().to(torch.bfloat16)
    tokens = torch.randint(config.vocab, (2, 1024), device="cuda")

    def loss_fn():
        return model(tokens, tokens)

    if zeros is not None:
        shift_to_sparsity(model, loss_fn, zeros)
    return model, loss_fn


def plain_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("zeros", [None, 0.9])
@pytest.mark.parametrize("sign_pack", [False, True])
def test_gpt_bf16_gradients_are_bit_identical(zeros, sign_pack):
    model, loss_fn = small_gpt(zeros)
    reference = plain_grads(model, loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(reference, plain_grads(model, loss_fn))), (
        "dense runs disagree: a nondeterministic kernel, not BitSparse"
    )
    for _ in range(3):  # several steps: the arena is reused and resized
        got = grads_of(model, loss_fn, sign_pack=sign_pack, min_numel=1024)
        assert all(torch.equal(a, b) for a, b in zip(reference, got))
    stats = bitsparse.stats()
    assert stats.tensors_compressed >= 3 and stats.tensors_recomputed >= 3
    assert stats.fallbacks == {}


def test_mlp_stack_autocast_gradients_are_bit_identical():
    torch.manual_seed(0)
    model = MLPStack(dim=512, hidden=2048, layers=3).cuda()
    x = torch.randn(2048, 512, device="cuda")

    def loss_fn():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x)

    reference = plain_grads(model, loss_fn)
    # A fresh session: an earlier test's smaller steps would bound the arena for DEMAND_STEPS
    # steps, and keep some of these tensors dense. The first step only measures.
    bitsparse.reset()
    for _ in range(3):
        got = grads_of(model, loss_fn, min_numel=1024)
        assert all(torch.equal(a, b) for a, b in zip(reference, got))
    # Autocast runs the square in float32 on a cast copy, so the relu output and that copy
    # are stored and nothing is recomputed.
    stats = bitsparse.stats()
    assert stats.tensors_compressed >= 3 and stats.fallbacks == {}


def test_tiny_arena_falls_back_and_stays_exact():
    model, loss_fn = small_gpt(0.9)
    reference = plain_grads(model, loss_fn)
    got = grads_of(model, loss_fn, capacity=1 << 16, min_numel=1024)
    assert all(torch.equal(a, b) for a, b in zip(reference, got))
    assert bitsparse.stats().fallbacks.get("arena_full", 0) > 0


def test_tensor_saved_on_another_stream_is_kept_dense():
    torch.manual_seed(0)
    w = torch.randn(512, 512, device="cuda", requires_grad=True)
    x = torch.randn(1024, 512, device="cuda")
    side = torch.cuda.Stream()

    def loss_fn():
        a = torch.relu(x @ w)  # the step's first stored tensor fixes the stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b = torch.relu(x @ w + 1)
        torch.cuda.current_stream().wait_stream(side)
        return (a * a).sum() + (b * b).sum()

    loss_fn().backward()
    reference, w.grad = w.grad, None
    with bitsparse.compressing(capacity=64 << 20):  # an arena from the first step
        loss = loss_fn()
    loss.backward()
    stats = bitsparse.stats()
    # a is stored; b, saved on the side stream, is kept dense; each product saves its
    # factor twice, and those saves share the first one's slot (b's stays dense).
    assert stats.fallbacks == {"other_stream": 1} and stats.tensors_compressed == 1
    assert stats.tensors_deduplicated == 4
    assert torch.equal(w.grad, reference)


def test_a_tensor_sure_to_fit_decoded_on_another_stream_waits_for_its_encoder():
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(1024, 4096).cuda(), torch.nn.Linear(4096, 8).cuda()
    x = torch.randn(4096, 1024, device="cuda")
    expected = torch.relu(lin1(x))
    torch.cuda.synchronize()
    with bitsparse.compressing(capacity=256 << 20):  # sure of room for the 16M-element output
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the encoder runs long after the host queued it
        y = lin2(torch.relu(lin1(x)))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        restored = y.grad_fn._saved_mat1  # unpacked on the side stream, its decoder queued there
    torch.cuda.synchronize()
    assert bitsparse.stats().tensors_compressed == 1
    assert torch.equal(restored, expected)


def test_a_step_less_sparse_than_the_last_spills_to_host_memory_exactly():
    # Sized for 90% zeros, then about half (the MLPs' biases zeroed): the values outrun the
    # arena's device part, and with the GPU far behind (a sleeping kernel) the host learns it
    # only after the forward.
    model, loss_fn = small_gpt(0.9)
    bitsparse.reset()
    for _ in range(2):
        grads_of(model, loss_fn, min_numel=1024)
    assert bitsparse.stats().spill_reserved > 0
    with torch.no_grad():
        for mlp in model.mlps():
            mlp.fc.bias.zero_()
    reference = plain_grads(model, loss_fn)

    def behind_a_sleep():
        torch.cuda._sleep(100_000_000)
        return loss_fn()

    assert all(torch.equal(a, b) for a, b in zip(reference, grads_of(model, behind_a_sleep, min_numel=1024)))
    stats = bitsparse.stats()
    assert stats.spilled_bytes > 0 and stats.fallbacks == {} and stats.window_waits == 0, str(stats)
    grads_of(model, loss_fn, min_numel=1024)  # the next step's device part takes them
    assert bitsparse.stats().spilled_bytes == 0


def step_without_host_synchronization(loss_fn) -> None:
    """One training step under ``compressing()`` in which any synchronizing call raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with bitsparse.compressing(min_numel=1024):
            loss = loss_fn()
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_training_step_has_no_host_synchronization():
    model, loss_fn = small_gpt(0.9)
    for _ in range(3):  # let the arena settle and the square check run once
        grads_of(model, loss_fn, min_numel=1024)
    step_without_host_synchronization(loss_fn)
    assert bitsparse.stats().tensors_compressed >= 3


def _cuda_bf16_case(name):
    """The CPU suite's models (tests/test_hooks.py), on CUDA in bf16."""
    import test_hooks as cpu

    builders = {
        "relu_mlp": (cpu.mlp, lambda: cpu.mlp_input(batch=4096)),
        "transformer_three_spellings": (cpu.transformer, lambda: cpu.sequence_input()),
        "convnet": (cpu.convnet, lambda: cpu.image_input()),
        "custom_function_with_mark": (lambda: cpu.CustomMLP(use_mark=True), lambda: cpu.mlp_input(batch=4096)),
    }
    build_model, build_input = builders[name]
    model = build_model().cuda().to(torch.bfloat16)
    x = build_input().cuda().to(torch.bfloat16).detach().requires_grad_()
    return model, x


@pytest.mark.parametrize("name", ["relu_mlp", "transformer_three_spellings", "convnet", "custom_function_with_mark"])
def test_cpu_suite_models_bf16_gradients_are_bit_identical(name):
    # A fresh session: the arena would otherwise be bounded, for its first DEMAND_STEPS steps,
    # by the smallest step of the model before (docs/design.md, "Growth policy").
    bitsparse.reset()
    model, x = _cuda_bf16_case(name)

    def step(compressed):
        model.zero_grad(set_to_none=True)
        x.grad = None
        with bitsparse.compressing(min_numel=256) if compressed else torch.enable_grad():
            out = model(x)
        out.float().square().mean().backward()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    reference = step(False)
    assert all(torch.equal(a, b) for a, b in zip(reference, step(False))), "dense runs disagree"
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(reference, step(True)))
    assert bitsparse.stats().tensors_compressed >= 1


class ReluProduct(torch.nn.Module):
    """``out(<after>(relu(fc(x))))``, the ReLU's output 90% zeros: dropout (T5's and VGG's
    MLPs; ``native_dropout`` on CUDA), a ReGLU's gate ``* up(x)`` (ProSparse's ReLU LLaMA), or
    a ReLU²-GLU's (the ReLU's square ``* up(x)``)."""

    def __init__(self, after: str, dim=512, hidden=2048):
        super().__init__()
        self.fc, self.out = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)
        with torch.no_grad():
            self.fc.bias.fill_(-0.74)  # 1.28 standard deviations of fc(x) for x ~ N(0, 1)
        self.after = torch.nn.Dropout(0.1) if after == "dropout" else torch.nn.Linear(dim, hidden)
        self.squared = after == "relu2_glu"

    def forward(self, x):
        h = torch.relu(self.fc(x))
        if isinstance(self.after, torch.nn.Dropout):
            return self.out(self.after(h))
        return self.out((h.square() if self.squared else h) * self.after(x))


def relu_product(after: str):
    """A bf16 ``ReluProduct`` on CUDA and its loss, each call from the same dropout mask."""
    torch.manual_seed(0)
    model = ReluProduct(after).cuda().to(torch.bfloat16)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)

    def loss_fn():
        torch.manual_seed(1)
        return model(x).float().square().mean()

    return model, loss_fn


@pytest.mark.parametrize("after", ["dropout", "reglu", "relu2_glu"])
def test_products_that_keep_a_relus_zeros_are_stored_or_recomputed_bit_exactly(after):
    """Dropout's output is stored beside the ReLU's; a ReGLU's product is recomputed from the
    ReLU's output and ``up(x)``, which its node saved; a ReLU²-GLU's from the square, itself
    recomputed from the ReLU's output."""
    bitsparse.reset()
    model, loss_fn = relu_product(after)
    reference = plain_grads(model, loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(reference, plain_grads(model, loss_fn))), "dense runs disagree"
    for _ in range(3):
        got = grads_of(model, loss_fn, min_numel=1024)
        assert all(torch.equal(a, b) for a, b in zip(reference, got))
    stats = bitsparse.stats()
    recomputed = {"dropout": 0, "reglu": 1, "relu2_glu": 2}[after]
    compressed = 1 if recomputed else 2
    assert (stats.tensors_compressed, stats.tensors_recomputed, stats.fallbacks) == (compressed, recomputed, {})


# --------------------------------------------------------------------------------------------
# Never worse off: no step peaks above the same step without BitSparse


class ResidualCNN(torch.nn.Module):
    """A small ResNet: a stem, then residual blocks of conv-batchnorm-ReLU (in place)."""

    def __init__(self, width=64, blocks=4):
        super().__init__()
        conv = lambda c_in, c_out, stride=1: torch.nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)  # noqa: E731
        self.stem = torch.nn.Sequential(conv(3, width, 2), torch.nn.BatchNorm2d(width), torch.nn.ReLU(inplace=True))
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                conv(width, width), torch.nn.BatchNorm2d(width), torch.nn.ReLU(inplace=True),
                conv(width, width), torch.nn.BatchNorm2d(width),
            )
            for _ in range(blocks)
        )
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu_(x + block(x))
        return self.head(x.mean((2, 3)))


def _cnn():
    torch.manual_seed(0)
    model = ResidualCNN().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(64, 3, 128, 128, device="cuda").to(memory_format=torch.channels_last)

    def loss_fn():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x).float().square().mean()

    return model, loss_fn


def _transformer():
    torch.manual_seed(0)
    config = GPTConfig(layers=4, dim=512, heads=4, head_dim=128, hidden=2048, vocab=8192)
    model = GPT(config).cuda().to(torch.bfloat16)
    tokens = torch.randint(config.vocab, (1, 4096), device="cuda")
    return model, lambda: model(tokens, tokens)


def _step_peaks(model, loss_fn, context, steps):
    """Each step's peak of allocated memory, everything the process holds included (the
    gradients, allocated by a step before, and BitSparse's arena, wherever it is allocated)."""
    peaks = []
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with context():
            loss = loss_fn()
        loss.backward()
        del loss
        torch.cuda.synchronize()
        peaks.append(max_memory_allocated())
    return peaks


@pytest.mark.parametrize("build", [_cnn, _transformer], ids=["resnet_style_cnn", "gpt"])
def test_no_step_peaks_above_dense(build):
    model, loss_fn = build()
    bitsparse.reset()
    dense = _step_peaks(model, loss_fn, torch.enable_grad, 3)  # the first allocates the gradients
    assert dense[1] == dense[2]
    peaks = _step_peaks(model, loss_fn, bitsparse.compressing, 4)
    stats = bitsparse.stats()
    assert stats.tensors_compressed > 0 and stats.fallbacks == {}, str(stats)
    assert peaks[0] <= dense[2], (peaks, dense)  # the first step measures, in host memory
    assert all(peak < dense[2] for peak in peaks[1:]), (peaks, dense)


def test_the_bench_counts_an_arena_that_the_measured_step_maps():
    # With one warmup step, the measured step maps the arena that the first one planned:
    # outside PyTorch's allocator (the spill region), before the step it is not there yet.
    torch.manual_seed(0)
    model = MLPStack(dim=512, hidden=2048, layers=3).cuda().to(torch.bfloat16)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)

    def loss_fn():
        return model(x)

    shift_to_sparsity(model, loss_fn, 0.9)
    measured = []
    for warmup in (1, 2):
        bitsparse.reset()
        (result,) = compare_modes(model, loss_fn, 4096, modes=["bitsparse"], repeats=1, warmup=warmup)
        measured.append(result.activation_mib)
    stats = bitsparse.stats()
    assert stats.spill_reserved > 0 and stats.fallbacks == {}, str(stats)
    # Equal but for the arena's counters and start words (in PyTorch's allocator, about 1 KiB),
    # which the step that maps the arena counts twice. Missing the arena, the first would be
    # its size less.
    assert stats.arena_reserved > 2**20
    assert abs(measured[0] - measured[1]) < 4096 / 2**20


@pytest.mark.parametrize("build", [_cnn, _transformer], ids=["resnet_style_cnn", "gpt"])
@pytest.mark.parametrize("window", [None, 1])
def test_a_host_far_ahead_of_the_gpu_peaks_no_higher_than_dense(build, window):
    # Each step queued behind a sleeping kernel: the host runs the whole forward ahead of the
    # GPU, so every store the arena is not sure of is held until a poll sees its report, as
    # many as the window and the hold allowance let.
    model, loss_fn = build()
    bitsparse.reset()

    def behind_a_sleep():
        torch.cuda._sleep(100_000_000)  # about 50 ms
        return loss_fn()

    dense = _step_peaks(model, behind_a_sleep, torch.enable_grad, 3)
    peaks = _step_peaks(model, behind_a_sleep, lambda: bitsparse.compressing(window=window), 4)
    stats = bitsparse.stats()
    assert stats.tensors_compressed > 0 and stats.fallbacks == {}, str(stats)
    assert all(peak <= dense[2] for peak in peaks[1:]), (peaks, dense)


def _pipeline_iteration(model, inputs, schedule, context, sync_check=False) -> tuple[list[torch.Tensor], int]:
    """One iteration of a pipeline ``schedule``, each forward under ``context()``, and with
    ``sync_check`` any synchronizing call raising: the gradients, and the iteration's peak of
    allocated memory."""
    model.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_sync_debug_mode("error" if sync_check else 0)
    try:
        run_iteration(model, inputs, schedule, context)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [p.grad.clone() for p in model.parameters()], max_memory_allocated()


@pytest.mark.parametrize("in_flight", [2, 3])
def test_a_pipeline_stage_is_exact_peaks_no_higher_than_dense_and_never_synchronizes(in_flight):
    """A 1F1B stage (8 microbatches) of a ReLU^2 MLP stack at 90% zeros in bf16: every step
    that begins while earlier microbatches wait for their backward is served by an arena of
    its own. Each iteration's gradients equal those without BitSparse, none peaks above an
    iteration without it, and once the arenas are planned an iteration calls nothing that
    synchronizes with the device."""
    torch.manual_seed(0)
    model = MLPStack(dim=256, hidden=1024, layers=3).cuda().to(torch.bfloat16)
    inputs = [torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    shift_to_sparsity(model, lambda: model(inputs[0]), 0.9)
    schedule = one_f_one_b(len(inputs), in_flight)
    bitsparse.reset()
    _pipeline_iteration(model, inputs, schedule, torch.enable_grad)  # allocates the gradients
    expected, dense = _pipeline_iteration(model, inputs, schedule, torch.enable_grad)
    peaks = []
    for iteration in range(4):
        got, peak = _pipeline_iteration(model, inputs, schedule, bitsparse.compressing, sync_check=iteration == 3)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        peaks.append(peak)
    stats = bitsparse.stats()
    assert stats.tensors_compressed == len(model.layers) and stats.fallbacks == {}, str(stats)
    assert peaks[0] <= dense and all(peak < dense for peak in peaks[1:]), (peaks, dense)
