"""The ``steps`` suite: the peak memory of each of a model's first training steps, dense and
with BitSparse, each mode in a fresh process.

A step is ``optimizer.zero_grad(); loss.backward(); optimizer.step()`` with SGD, the loss's
forward inside the mode's context (``bitsparse.compressing()`` for BitSparse; see
``training.mode_context``). A step's peak is the most memory
allocated during it, everything the process holds included: the model, its gradients and
BitSparse's arena. Models: the benchmarks' 12-layer GPT (``gpt``), torchvision's ResNet-50
(``resnet50``: batch 128, 224x224, bfloat16 autocast, channels-last; needs torchvision;
the ``vision`` suite runs it in more modes) and a
Hugging Face OPT of 12 layers, d=1024, with ReLU (``opt``: random weights from its config, no
download; needs transformers).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys

import torch

from bitsparse.bench import training

MODES = ("dense", "bitsparse")
CHILD_MODES = ("dense", "checkpoint", "offload", "bitsparse")
"""Modes a child process can run (``checkpoint``: the models that have ``set_checkpointing``)."""
MODELS = ("gpt", "resnet50", "opt")
DEFAULT_LENGTH = {"gpt": 12000, "opt": 4096}
"""Tokens per sequence, by model (the GPT suite's length; the OPT of a Hugging Face repro)."""
DEFAULT_BATCH = {"gpt": 1, "resnet50": 128, "opt": 1}


def build(model_name: str, length: int | None, batch: int | None, quick: bool):
    """``(model, loss_fn)`` for a fresh model on the device, seeded."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    length = length or (64 if quick else DEFAULT_LENGTH.get(model_name))
    batch = batch or (2 if quick else DEFAULT_BATCH[model_name])
    if model_name == "gpt":
        from bitsparse.bench.models import GPT, GPTConfig

        config = GPTConfig(layers=2, dim=64, heads=2, head_dim=32, hidden=256, vocab=512) if quick else GPTConfig()
        model = GPT(config).to(device=device, dtype=torch.bfloat16)
        tokens = torch.randint(config.vocab, (batch, length), device=device)
        return model, lambda: model(tokens, tokens)
    if model_name == "resnet50":
        from bitsparse.bench.models import ResNetStages

        size = 64 if quick else 224
        model = ResNetStages().to(device=device, memory_format=torch.channels_last)
        images = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
        labels = torch.randint(1000, (batch,), device=device)

        def loss_fn():
            with torch.autocast(device, dtype=torch.bfloat16):
                return torch.nn.functional.cross_entropy(model(images), labels)

        return model, loss_fn
    if model_name == "opt":
        from transformers import OPTConfig, OPTForCausalLM

        config = OPTConfig(
            num_hidden_layers=2 if quick else 12,
            hidden_size=64 if quick else 1024,
            ffn_dim=256 if quick else 4096,
            num_attention_heads=2 if quick else 16,
            activation_function="relu",
            max_position_embeddings=max(length, 2048),
        )
        model = OPTForCausalLM(config).to(device=device, dtype=torch.bfloat16)
        tokens = torch.randint(config.vocab_size, (batch, length), device=device)
        return model, lambda: model(input_ids=tokens, labels=tokens).loss
    raise ValueError(f"unknown model {model_name!r}: choose one of {MODELS}")


def step_peaks(model_name: str, mode: str, args: argparse.Namespace) -> list[int]:
    """Train ``args.steps`` steps of ``model_name`` (of ``args.length``, ``args.batch``,
    ``args.quick``) in ``mode``; each step's peak of allocated bytes (0 off CUDA)."""
    model, loss_fn = build(model_name, args.length, args.batch, args.quick)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    options = training.bitsparse_options(args)
    if mode == "checkpoint":
        model.set_checkpointing(True)
    cuda = torch.cuda.is_available()
    peaks = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        optimizer.zero_grad()
        with training.mode_context(mode, **options):
            loss = loss_fn()
        loss.backward()
        optimizer.step()
        del loss
        if cuda:
            torch.cuda.synchronize()
        peaks.append(training.max_memory_allocated() if cuda else 0)
    return peaks


def run(args: argparse.Namespace) -> list[dict]:
    """Each model and mode in a fresh process; print a table per model, write ``steps.csv``."""
    rows = []
    for model_name in args.models:
        peaks = {mode: peaks_in_fresh_process(model_name, mode, args) for mode in MODES}
        print(f"{model_name}: peak allocated per step, MiB (each mode in a fresh process)")
        print(f"{'step':>4}  {'dense':>10}  {'bitsparse':>10}  {'ratio':>6}")
        for step, (dense, compressed) in enumerate(zip(peaks["dense"], peaks["bitsparse"]), 1):
            ratio = compressed / dense if dense else float("nan")
            print(f"{step:>4}  {dense / 2**20:>10.1f}  {compressed / 2**20:>10.1f}  {ratio:>6.3f}")
            rows.append({"model": model_name, "step": step, "dense_bytes": dense, "bitsparse_bytes": compressed})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "steps.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "step", "dense_bytes", "bitsparse_bytes"])
        writer.writeheader()
        writer.writerows(rows)
    return rows


def peaks_in_fresh_process(model_name: str, mode: str, args: argparse.Namespace) -> list[int]:
    """``step_peaks`` of ``model_name`` in ``mode``, run in a new Python process (so nothing
    an earlier mode allocated or cached counts), with ``args.steps``, ``length``, ``batch``
    ``quick``, ``window`` and ``host_spill``."""
    command = [sys.executable, "-m", "bitsparse.bench", "steps", "--child", mode, "--models", model_name]
    window = "none" if args.window is None else str(args.window)
    command += ["--steps", str(args.steps), "--window", window] + (["--quick"] if args.quick else [])
    command += [] if args.host_spill else ["--no-host-spill"]
    command += ["--length", str(args.length)] if getattr(args, "length", None) else []
    command += ["--batch", str(args.batch)] if args.batch else []
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def child(args: argparse.Namespace) -> None:
    """One model in one mode: print its step peaks as JSON on the last line."""
    (model_name,) = args.models
    print(json.dumps(step_peaks(model_name, args.child, args)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["gpt"], choices=MODELS)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--length", type=int, help=f"tokens per sequence (default {DEFAULT_LENGTH})")
    parser.add_argument("--batch", type=int, help=f"sequences or images per step (default {DEFAULT_BATCH})")
    parser.add_argument("--quick", action="store_true", help="tiny models that run on the CPU")
    parser.add_argument("--out", default=".", help="folder for steps.csv")
    parser.add_argument("--child", choices=CHILD_MODES, help=argparse.SUPPRESS)
    training.add_bitsparse_arguments(parser)
