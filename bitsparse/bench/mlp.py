"""The ``mlp`` suite: 8 residual layers x = x + W2 relu(W1 rmsnorm(x))^2, d=4096, hidden 21504."""

from __future__ import annotations

import argparse

import torch

from bitsparse.bench import training
from bitsparse.bench.models import MLPStack


def run(args: argparse.Namespace) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dim, hidden, layers = (64, 336, 2) if args.quick else (4096, 21504, 8)
    sizes = [128, 256] if args.quick else args.rows

    def build(rows: int):
        model = MLPStack(dim, hidden, layers).to(device=device, dtype=torch.bfloat16)
        x = torch.randn(rows, dim, device=device, dtype=torch.bfloat16)
        return model, lambda: model(x), rows

    return training.run_suite(args, "mlp", "rows", sizes, build, f"MLP stack ({layers} x {dim}->{hidden}), bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[8000, 16000, 32000])
    training.add_common_arguments(parser, zeros_default=[None, 0.9])
