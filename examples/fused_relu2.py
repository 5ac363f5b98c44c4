"""A fused Linear + ReLU^2 MLP as a custom autograd Function, whose saved output BitSparse compresses.

In the style of Modded-NanoGPT's fused MLP: the forward computes ``pre = x @ W_fc.T`` and
``post = relu(pre) ** 2`` itself and saves both with ``ctx.save_for_backward``. Autograd records
no producer for tensors made inside a Function's forward, so BitSparse cannot tell that
``post`` is a squared ReLU output; the Function's author says so with ``bitsparse.mark(post)``
(and saves what ``mark`` returns, as its docstring asks, so that ``torch.compile`` sees the mark).

    python examples/fused_relu2.py              # eager, then compiled (CPU inductor or CUDA)
    python examples/fused_relu2.py --eager      # eager only

Checks that the gradients with and without ``bitsparse.compressing()`` are identical bit for
bit, prints what BitSparse stored, and exits non-zero if anything differs. About 15 s on a
2-core CPU, most of it compiling.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import bitsparse


class FusedLinearReLUSquare(torch.autograd.Function):
    """``relu(x @ w_fc.T) ** 2 @ w_proj.T``, saving the pre-activation and the squared output.

    Shapes: ``x`` (..., d), ``w_fc`` (hidden, d), ``w_proj`` (d_out, hidden); the result is
    (..., d_out). The squared output is flagged with ``bitsparse.mark`` so that BitSparse
    stores it compressed under ``compressing()``/``enable()``; elsewhere the mark costs nothing.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> torch.Tensor:
        pre = x @ w_fc.T
        post = bitsparse.mark(torch.relu(pre).square())
        ctx.save_for_backward(x, w_fc, w_proj, pre, post)
        return post @ w_proj.T

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, w_fc, w_proj, pre, post = ctx.saved_tensors
        grad_post = grad_out @ w_proj
        grad_pre = grad_post * 2 * torch.relu(pre)  # d relu(pre)^2 / d pre
        grad_x = grad_pre @ w_fc
        grad_w_fc = grad_pre.flatten(0, -2).T @ x.flatten(0, -2)
        grad_w_proj = grad_out.flatten(0, -2).T @ post.flatten(0, -2)
        return grad_x, grad_w_fc, grad_w_proj


class FusedMLP(torch.nn.Module):
    """A ReLU^2 MLP block (d -> hidden -> d) that runs ``FusedLinearReLUSquare``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_fc = torch.nn.Parameter(torch.randn(hidden, dim) / dim**0.5)
        self.w_proj = torch.nn.Parameter(torch.randn(dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FusedLinearReLUSquare.apply(x, self.w_fc, self.w_proj)


def gradients(model: torch.nn.Module, x: torch.Tensor, context) -> list[torch.Tensor]:
    """One forward (inside ``context``) and backward; the parameters' and the input's gradients."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    with context:
        out = model(x)
    out.square().mean().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def check(model: torch.nn.Module, x: torch.Tensor, label: str) -> bitsparse.Stats:
    """Compare plain gradients with three steps under ``compressing()`` (the first only measures
    what it would store); exit non-zero unless identical and the marked output is compressed."""
    plain = gradients(model, x, contextlib.nullcontext())
    for _ in range(3):
        compressed = gradients(model, x, bitsparse.compressing(min_numel=1024))
        if not all(torch.equal(a, b) for a, b in zip(plain, compressed)):
            raise SystemExit(f"{label}: gradients with and without BitSparse differ: please report this")
    stats = bitsparse.stats()
    print(f"{label}: gradients identical with and without BitSparse (bit for bit)\n  {stats}")
    if stats.tensors_compressed < 1:
        raise SystemExit(f"{label}: the marked ReLU^2 output was not compressed")
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="skip the torch.compile run")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = FusedMLP(dim=64, hidden=256).to(device)
    # At initialisation half the pre-activations are negative, so the ReLU^2 output is half
    # zeros (trained ReLU networks reach 88-97%, and BitSparse stores them smaller still).
    x = torch.randn(8, 128, 64, device=device, requires_grad=True)
    check(model, x, f"eager ({device})")
    if not args.eager:
        check(torch.compile(model), x, f"torch.compile ({device})")


if __name__ == "__main__":
    main(sys.argv[1:])
