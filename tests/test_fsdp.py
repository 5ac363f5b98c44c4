"""BitSparse with FSDP2 (``fully_shard``), next to the eager numerics tests.

One process with the gloo backend: FSDP2's hooks gather each layer's parameters before its
forward and free them after, and the saved ``weight.t()`` views must still be recognised as
parameters (not compressed) while the ReLU outputs are, with gradients exactly those of the
sharded model without BitSparse.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from test_hooks import OPTIONS, clean_session, mlp, mlp_input  # noqa: F401 (autouse fixture)

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


def test_fully_sharded_mlp_stays_exact(one_process_group):
    model, x = mlp(), mlp_input()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)

    def gradients(ctx):
        model.zero_grad(set_to_none=True)
        x.grad = None
        with ctx:
            out = model(x)
        out.square().mean().backward()
        return [p.grad.full_tensor() for p in model.parameters()] + [x.grad.clone()]

    expected = gradients(contextlib.nullcontext())
    got = gradients(bitsparse.compressing(**OPTIONS))
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    s = bitsparse.stats()
    assert s.tensors_compressed == 2  # the two ReLU outputs
    # Each Linear's weight.t(), and the input: leaves that require grad.
    assert s.tensors_skipped.get("parameter", 0) == 4
