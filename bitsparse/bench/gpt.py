"""The ``gpt`` suite: the 12-layer GPT of SPEC.md section 2, batch 1, at several sequence lengths."""

from __future__ import annotations

import argparse
import os

import torch

from bitsparse.bench import training
from bitsparse.bench.models import GPT, GPTConfig, shift_to_sparsity


def run(args: argparse.Namespace) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        config = GPTConfig(layers=2, dim=64, heads=2, head_dim=32, hidden=256, vocab=512)
        lengths, repeats, warmup = [128], 2, 1
    else:
        config = GPTConfig()
        lengths, repeats, warmup = args.lengths, args.repeats, 3
    modes = args.modes
    rows = []
    for zeros in args.zeros:
        for length in lengths:
            torch.manual_seed(0)
            model = GPT(config).to(device=device, dtype=torch.bfloat16)
            tokens = torch.randint(config.vocab, (1, length), device=device)
            targets = torch.randint(config.vocab, (1, length), device=device)

            def loss_fn():
                return model(tokens, targets)

            if zeros is not None:
                shift_to_sparsity(model, loss_fn, zeros)
            results = training.compare_modes(model, loss_fn, length, modes, repeats, warmup)
            label = f"{int(100 * zeros)}%" if zeros is not None else "init"
            training.print_table(f"gpt T={length}, MLP zeros {label}", results)
            rows += training.as_rows(results, suite="gpt", T=length, zeros=label)
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    training.write_csv(os.path.join(args.out, "gpt.csv"), rows)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 12000, 16384])
    parser.add_argument("--zeros", type=lambda s: None if s == "init" else float(s), nargs="+",
                        default=[None, 0.9], help="MLP zero fractions ('init' = as initialised)")
    parser.add_argument("--modes", nargs="+", default=list(training.MODES), choices=training.MODES)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="a tiny configuration for CPU tests")
    parser.add_argument("--out", default=".", help="folder for the CSV")
