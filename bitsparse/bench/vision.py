"""The ``vision`` suite: torchvision's ResNet-50 (batch 128, 224x224, bfloat16 autocast,
channels-last) trained dense, with each of its four stages checkpointed, with
``save_on_cpu`` and with BitSparse. Needs torchvision.

Peak memory is each mode's steady step (the last of ``--steps``) in a fresh process, everything
the process holds included (model, gradients, an arena that outlives the step); step times are
medians over interleaved rounds in one process (``training.compare_modes``), with the host's
time to queue the forward beside them.
"""

from __future__ import annotations

import argparse

import torch

import bitsparse
from bitsparse.bench import steps, training

MODES = ("dense", "checkpoint", "offload", "bitsparse")


def run(args: argparse.Namespace) -> list[dict]:
    peaks = {mode: steps.peaks_in_fresh_process("resnet50", mode, args)[-1] for mode in args.modes}
    model, loss_fn = steps.build("resnet50", None, args.batch, args.quick)
    batch = args.batch or (2 if args.quick else steps.DEFAULT_BATCH["resnet50"])
    options = training.bitsparse_options(args)
    results = training.compare_modes(model, loss_fn, batch, args.modes, args.repeats, args.warmup, options)
    dense_peak = peaks.get("dense")
    print(f"ResNet-50, batch {batch}: steady peak in a fresh process; step time, interleaved medians")
    print(f"  {'mode':<12}{'peak MiB':>10}{'vs dense':>10}{'ms':>9}{'IQR':>7}{'fwd host':>9}{'vs dense':>10}  grads")
    rows = []
    for r in results:
        peak = peaks[r.mode]
        relative = f"{peak / dense_peak:.3f}x" if dense_peak else "-"
        grads = {True: "equal", False: "DIFFER", None: "-"}[r.grads_equal_dense]
        print(
            f"  {r.mode:<12}{peak / 2**20:>10.0f}{relative:>10}{r.step_ms:>9.1f}{r.step_ms_spread:>7.1f}"
            f"{r.forward_host_ms:>9.1f}{r.overhead_pct:>+9.1f}%  {grads}"
        )
        rows.append({"mode": r.mode, "peak_bytes": peak, "step_ms": r.step_ms, "overhead_pct": r.overhead_pct,
                     "forward_host_ms": r.forward_host_ms, "grads_equal_dense": r.grads_equal_dense})  # fmt: skip
    if torch.cuda.is_available():
        print(f"  bitsparse: {bitsparse.stats()}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--batch", type=int, help="images per step (default 128; 2 with --quick)")
    parser.add_argument("--steps", type=int, default=4, help="steps per fresh process; the last one's peak counts")
    parser.add_argument("--repeats", type=int, default=10, help="interleaved timing rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--quick", action="store_true", help="64x64 images, batch 2: runs on the CPU")
    training.add_bitsparse_arguments(parser)
