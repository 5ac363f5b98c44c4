"""BitSparse around a ``torch.compile``d forward, next to the eager numerics tests.

Compiling is not supported yet (docs/design.md, "Threads, devices, and other machinery"):
a compiled forward saves its tensors from one autograd node, without the nodes that
produced them, so the default selection finds no ReLU and ``select="all"`` compresses what
pays. Either way the gradients must be exactly those of the compiled model without
BitSparse.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_hooks import OPTIONS, assert_same_grads, clean_session, mlp, mlp_input, train_step  # noqa: F401 (autouse fixture)

import bitsparse


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_stays_exact(backend):
    torch._dynamo.reset()
    model, x = mlp(), mlp_input()
    compiled = torch.compile(model, backend=backend)
    expected = train_step(compiled, x, contextlib.nullcontext())

    got = train_step(compiled, x, bitsparse.compressing(**OPTIONS))
    assert_same_grads(got, expected)
    s = bitsparse.stats()
    assert s.tensors_seen > 0 and s.tensors_compressed == 0  # no producer nodes to read
    assert s.tensors_skipped.get("not_relu_family", 0) > 0

    got = train_step(compiled, x, bitsparse.compressing(**OPTIONS, select="all"))
    assert_same_grads(got, expected)
    assert bitsparse.stats().tensors_compressed >= 1
