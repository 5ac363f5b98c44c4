"""BitSparse on a model split over devices in one process, as Hugging Face's ``device_map``
places a model too large for one GPU: the blocks on the first device, then on the second, the
activations moved between them. Each device has its own arena and its tensors' kernels run on
it whichever device is current; gradients stay bit-identical to the same split without
BitSparse, eager and compiled block by block, and a step between two GPUs waits for neither.
"""

import pytest
import torch
from test_gpu_compile import fresh, grads  # noqa: F401 (fresh: autouse fixture)
from test_gpu_hooks import step_without_host_synchronization

import bitsparse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
SPLITS = {
    "cuda0+cpu": ("cuda:0", "cpu"),
    "cuda0+cuda1": pytest.param(("cuda:0", "cuda:1"), marks=TWO_GPUS),
    "cuda1+cuda0": pytest.param(("cuda:1", "cuda:0"), marks=TWO_GPUS),
}
BLOCKS_PER_DEVICE = 2
STEPS = 3


class SplitMLP(torch.nn.Module):
    """Residual ReLU blocks ``x + fc2(relu(fc1(x)))``, ``BLOCKS_PER_DEVICE`` on each of
    ``devices`` in turn, in bfloat16: each block stores one ReLU output on its device."""

    def __init__(self, devices, dim=256, hidden=1024):
        super().__init__()
        torch.manual_seed(0)
        self.devices = [torch.device(d) for d in devices for _ in range(BLOCKS_PER_DEVICE)]
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim)).to(
                device, torch.bfloat16
            )
            for device in self.devices
        )

    def forward(self, x):
        for device, block in zip(self.devices, self.blocks):
            x = x.to(device)
            x = x + block(x)
        return x.float().square().mean()


def split_case(devices, compiled: bool):
    model = SplitMLP(devices)
    if compiled:
        for block in model.blocks:
            block.compile()
    x = torch.randn(2048, 256, device=devices[0], dtype=torch.bfloat16)
    return model, lambda: model(x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("devices", SPLITS.values(), ids=SPLITS.keys())
def test_a_model_split_over_devices_keeps_its_gradients(devices, compiled):
    model, loss_fn = split_case(devices, compiled)
    reference = grads(model, loss_fn, torch.enable_grad())
    assert all(torch.equal(a, b) for a, b in zip(reference, grads(model, loss_fn, torch.enable_grad()))), (
        "dense runs disagree: a nondeterministic kernel, not BitSparse"
    )
    for _ in range(STEPS):  # the first step measures, the next ones store
        got = grads(model, loss_fn, bitsparse.compressing())
        assert all(torch.equal(a, b) for a, b in zip(reference, got))
    stats = bitsparse.stats()
    assert stats.tensors_compressed == len(model.blocks), str(stats)
    assert stats.fallbacks == {}, str(stats)
    assert stats.tensors_alive == 0, str(stats)


@TWO_GPUS
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_step_over_two_gpus_has_no_host_synchronization(compiled):
    model, loss_fn = split_case(("cuda:0", "cuda:1"), compiled)
    for _ in range(STEPS):
        grads(model, loss_fn, bitsparse.compressing(min_numel=1024))
    step_without_host_synchronization(loss_fn)
    assert bitsparse.stats().tensors_compressed == len(model.blocks)
