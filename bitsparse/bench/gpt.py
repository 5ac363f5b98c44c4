"""The ``gpt`` suite: a 12-layer GPT (``GPTConfig``: d=768, ReLU^2 MLP 768->3072->768), batch 1, at several lengths."""

from __future__ import annotations

import argparse

import torch

from bitsparse.bench import training
from bitsparse.bench.models import GPT, GPTConfig


def run(args: argparse.Namespace) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = GPTConfig(layers=2, dim=64, heads=2, head_dim=32, hidden=256, vocab=512) if args.quick else GPTConfig()
    lengths = [64, 128] if args.quick else args.lengths

    def build(length: int):
        model = GPT(config).to(device=device, dtype=torch.bfloat16)
        tokens = torch.randint(config.vocab, (1, length), device=device)
        targets = torch.randint(config.vocab, (1, length), device=device)
        return model, lambda: model(tokens, targets), length

    return training.run_suite(args, "gpt", "T", lengths, build, "12-layer GPT, batch 1, bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 12000, 16384])
    training.add_common_arguments(parser, zeros_default=[None, 0.9])
