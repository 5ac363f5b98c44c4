"""The fused Linear + ReLU^2 custom autograd Function of ``examples/fused_relu2.py`` (in the
style of Modded-NanoGPT's MLP), whose author marks the squared output with ``bitsparse.mark``:
gradients bit-identical with and without ``compressing()``, eagerly and compiled, and the
marked tensor stored compressed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from test_compile import compiled_steps, fresh_dynamo, fullgraph  # noqa: F401 (fresh_dynamo: autouse)
from test_hooks import (  # noqa: F401 (clean_session: autouse fixture)
    check_exact,
    clean_session,
    expected_nbytes,
    mlp_input,
)

import bitsparse

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fused_relu2.py"


def load_example():
    spec = importlib.util.spec_from_file_location("fused_relu2", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fused_relu2 = load_example()


def fused_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return fused_relu2.FusedMLP(dim=32, hidden=256)


def squared_output(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the Function saves as its squared output, computed outside it."""
    return torch.relu(x @ model.w_fc.T).square().detach()


def test_eager_marked_output_is_compressed_and_gradients_are_exact():
    model, x = fused_mlp(), mlp_input()
    post = squared_output(model, x)
    nbytes, nnz = expected_nbytes(post)
    for s in check_exact(model, x, steps=3):  # check_exact: gradients equal to plain, bit for bit
        # The marked squared output, and only it: x and the two weights (leaves that require
        # grad) and the pre-activation (no producer autograd can see, not marked) stay as they are.
        assert (s.tensors_seen, s.tensors_compressed, s.fallbacks) == (5, 1, {}), str(s)
        assert s.tensors_skipped == {"not_relu_family": 1, "parameter": 3}
        assert s.dense_bytes == post.numel() * 4 and s.stored_bytes == nbytes
        assert s.zero_fraction == pytest.approx(1 - nnz / post.numel(), abs=1e-12)
        assert s.ratio > 1.5


def test_eager_without_the_mark_nothing_is_compressed(monkeypatch):
    monkeypatch.setattr(bitsparse, "mark", lambda t: t)  # the Function calls bitsparse.mark
    model, x = fused_mlp(), mlp_input()
    for s in check_exact(model, x, steps=2):
        assert s.tensors_compressed == 0 and s.tensors_skipped["not_relu_family"] == 2, str(s)


def test_compiled_marked_function_is_exact_and_compressed():
    model, x = fused_mlp(), mlp_input()
    stats, frames, _ = compiled_steps(model, x, steps=3, compile=fullgraph)
    assert frames == 1  # compiled once, and not again under compressing()
    post = squared_output(model, x)
    for s in stats:
        # Everything the compiled forward hands to BitSparse is stored compressed: the marked
        # square (and the ReLU output the backward needs).
        assert s.tensors_compressed == s.tensors_seen >= 1 and s.fallbacks == {}, str(s)
        assert s.dense_bytes >= post.numel() * 4 and s.ratio > 1.5


def test_example_runs_eagerly(capsys):
    fused_relu2.main(["--eager"])  # exits non-zero if gradients differ or nothing is compressed
    out = capsys.readouterr().out
    assert "gradients identical with and without BitSparse (bit for bit)" in out
    assert "1/5 saved tensors compressed" in out
