"""BitSparse with FSDP2 (``fully_shard``), next to the eager numerics tests.

One process with the gloo backend: FSDP2's hooks gather each layer's parameters before its
forward and free them after, and the saved ``weight.t()`` views must still be recognised as
parameters (not compressed) while the ReLU outputs are, with gradients exactly those of the
sharded model without BitSparse; eager, and with each sharded block compiled.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from test_hooks import OPTIONS, clean_session, mlp, mlp_input, sequence_input, transformer  # noqa: F401 (autouse fixture)
from torch._dynamo.testing import CompileCounterWithBackend

import bitsparse

fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard


@pytest.fixture
def one_process_group():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_gradients(model, x, ctx) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x.grad = None
    with ctx:
        out = model(x)
    out.square().mean().backward()
    return [p.grad.full_tensor() for p in model.parameters()] + [x.grad.clone()]


def assert_same(actual, expected) -> None:
    assert len(actual) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(actual, expected))


def test_fully_sharded_mlp_stays_exact(one_process_group):
    model, x = mlp(), mlp_input()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)

    expected = sharded_gradients(model, x, contextlib.nullcontext())
    assert_same(sharded_gradients(model, x, bitsparse.compressing(**OPTIONS)), expected)
    s = bitsparse.stats()
    assert s.tensors_compressed == 2  # the two ReLU outputs
    # Each Linear's weight.t(), and the input: leaves that require grad.
    assert s.tensors_skipped.get("parameter", 0) == 4


def test_fully_sharded_blocks_compiled_stay_exact(one_process_group):
    """Each block sharded, then compiled (FSDP2's pattern): the ReLU outputs are stored inside
    the compiled blocks, the blocks compile once more for BitSparse's hooks, and never again."""
    torch._dynamo.reset()
    model, x = transformer(), sequence_input()
    counter = CompileCounterWithBackend("inductor")
    for block in model:
        fully_shard(block)
        block.compile(backend=counter)
    fully_shard(model)

    expected = sharded_gradients(model, x, contextlib.nullcontext())
    frames = counter.frame_count
    for _ in range(3):
        assert_same(sharded_gradients(model, x, bitsparse.compressing(**OPTIONS)), expected)
        assert bitsparse.stats().tensors_compressed == 3  # one ReLU output per block
    assert counter.frame_count == 2 * frames
    torch._dynamo.reset()
