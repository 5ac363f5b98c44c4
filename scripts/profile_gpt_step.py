"""Where does a BitSparse GPT step lose time? Variants of one step at T=12000 on CUDA.

Prints, per variant, the median GPU step time over interleaved repeats (CUDA events), the
host time until backward returns and until the forward returns, the peak memory per token
and the window waits; then a kernel table from torch.profiler for dense and bitsparse, and the
host time of BitSparse's stages (pack, store, the arena, the tables, unpack, the step's
accounting, ...).

Usage: python scripts/profile_gpt_step.py [--out DIR] [--length T]
"""

import argparse
import contextlib
import functools
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import bitsparse
from bitsparse.allocator import Arena
from bitsparse.bench.models import sparse_gpt_loss
from bitsparse.hooks import handles, manager
from bitsparse.hooks.spans import SpanIndex

VARIANTS = {
    "dense": lambda: contextlib.nullcontext(),
    "identity hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    "bitsparse, nothing stored": lambda: bitsparse.compressing(min_numel=1 << 62),
    "bitsparse": lambda: bitsparse.compressing(),
    "bitsparse 15-bit": lambda: bitsparse.compressing(sign_pack=True),
}
"""The BitSparse variants share their arena options, so that none reallocates the arena."""
STAGES = [
    (manager.Session, "pack"),
    (manager.Session, "unpack"),
    (manager.Session, "_store"),
    (manager.Session, "_recompute"),
    (manager.Session, "_poll"),
    (manager.Session, "_settle_for_reads"),
    (manager.Session, "_begin_step"),
    (manager.Session, "_site"),
    (handles.Site, "prepare"),
    (handles.StoredTensor, "__init__"),
    (handles.StoredTensor, "_restore"),
    (handles.Recomputed, "_restore"),
    (Arena, "submit"),
    (Arena, "reserve_fixed"),
    (Arena, "next_report"),
    (Arena, "next_start"),
    (Arena, "on_append_stream"),
    (Arena, "drain"),
    (SpanIndex, "add"),
    (SpanIndex, "find"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--length", type=int, default=12000)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    _, loss_fn = sparse_gpt_loss(args.length)

    def step(variant: str) -> None:
        with VARIANTS[variant]():
            loss = loss_fn()
        loss.backward()

    for _ in range(3):
        for variant in VARIANTS:
            step(variant)
    gpu, host, forward, memory, waits = ({v: [] for v in VARIANTS} for _ in range(5))
    for _ in range(args.repeats):
        for variant, context in VARIANTS.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            t0 = time.perf_counter()
            start.record()
            with context():
                loss = loss_fn()
            forward[variant].append(1000 * (time.perf_counter() - t0))
            loss.backward()
            end.record()
            host[variant].append(1000 * (time.perf_counter() - t0))
            end.synchronize()
            gpu[variant].append(start.elapsed_time(end))
            memory[variant].append(torch.cuda.max_memory_allocated() - base)
            if variant.startswith("bitsparse"):
                stats = bitsparse.stats()
                waits[variant].append(stats.window_waits)
                memory[variant][-1] += stats.arena_reserved
    dense_ms = statistics.median(gpu["dense"])
    print(f"T={args.length}, {args.repeats} interleaved repeats")
    print(f"{'variant':<28}{'step ms':>9}{'vs dense':>10}{'host ms':>9}{'fwd ms':>9}{'MiB/token':>11}{'waits':>7}")
    for variant in VARIANTS:
        ms = statistics.median(gpu[variant])
        print(
            f"{variant:<28}{ms:>9.2f}{100 * (ms / dense_ms - 1):>+9.1f}%{statistics.median(host[variant]):>9.1f}"
            f"{statistics.median(forward[variant]):>9.1f}"
            f"{max(memory[variant]) / 2**20 / args.length:>11.4f}"
            f"{statistics.median(waits[variant]) if waits[variant] else 0:>7}"
        )

    for variant in ("dense", "bitsparse"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(variant)
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(args.out, f"trace-{variant}.json"))
        print(f"\n== {variant}: kernels by GPU time")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))

    # Host time of BitSparse's stages, by wrapping them with timers (nested stages overlap).
    totals: dict[str, list] = {}
    for owner, name in STAGES:
        label = f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"
        setattr(owner, name, _timed(getattr(owner, name), label, totals))
    steps = 5
    for _ in range(steps):
        step("bitsparse")
    torch.cuda.synchronize()
    print(f"\n== host time of BitSparse's stages, per step of {steps}")
    print(f"{'stage':<32}{'calls':>7}{'ms':>9}{'us/call':>9}")
    for stage, (calls, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{stage:<32}{calls // steps:>7}{1000 * seconds / steps:>9.2f}{1e6 * seconds / calls:>9.1f}")


def _timed(fn, label: str, totals: dict):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = totals.setdefault(label, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t0

    return timed


if __name__ == "__main__":
    main()
