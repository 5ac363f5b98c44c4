"""Where a compiled BitSparse GPT step spends what it adds: the whole forward compiled (or, with
``--compile-scope block``, each block), dense and BitSparse, on CUDA.

Prints the median GPU step time over interleaved rounds (CUDA events), the host time of entering
the mode and of the forward, and the memory per token; then, from one profiled step of each mode,
with a spin kernel marking the step's start and the end of its forward: the time from the mark
to the first kernel and to the compiled graph's first kernel, and the kernels' busy and idle time
in the forward and the backward, and the longest idle gaps with the kernels around them; then the
kernels whose total time differs between the modes.
Usage: python scripts/profile_compiled_step.py [--length T] [--rounds N] [--compile-scope model|block]
"""

import argparse
import collections
import json
import os
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import bitsparse
from bitsparse.bench.models import sparse_gpt_loss
from bitsparse.bench.training import COMPILE_SCOPES, compiled

MODES = {"compiled dense": torch.enable_grad, "compiled bitsparse": bitsparse.compressing}
MARK = "spin_kernel"
GAPS = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=12000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--compile-scope", default="model", choices=COMPILE_SCOPES)
    args = parser.parse_args()
    model, loss_fn = sparse_gpt_loss(args.length)
    compiled_loss_fn = compiled(model, loss_fn, args.compile_scope)

    def step(mode: str, marked: bool = False) -> tuple[float, float]:
        if marked:
            torch.cuda._sleep(100)
        start = time.perf_counter()
        with MODES[mode]():
            entered = time.perf_counter()
            loss = compiled_loss_fn()
        forward = time.perf_counter()
        if marked:
            torch.cuda._sleep(100)
        loss.backward()
        return entered - start, forward - start

    for _ in range(3):
        for mode in MODES:
            step(mode)
    rows = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            enter_s, forward_s = step(mode)
            end.record()
            end.synchronize()
            arena = bitsparse.stats().arena_reserved if mode == "compiled bitsparse" else 0
            memory = (torch.cuda.max_memory_allocated() - base + arena) / 2**20 / args.length
            rows[mode].append((begin.elapsed_time(end), 1e6 * enter_s, 1e3 * forward_s, memory))
    dense_ms = statistics.median(r[0] for r in rows["compiled dense"])
    print(f"T={args.length}, compiled: {args.compile_scope}, {args.rounds} interleaved rounds, "
          f"torch {torch.__version__}")
    print(f"{'mode':<20}{'step ms':>9}{'vs dense':>10}{'enter us':>10}{'fwd host ms':>13}{'MiB/token':>11}")
    for mode, rs in rows.items():
        ms = statistics.median(r[0] for r in rs)
        print(
            f"{mode:<20}{ms:>9.2f}{100 * (ms / dense_ms - 1):>+9.2f}%{statistics.median(r[1] for r in rs):>10.0f}"
            f"{statistics.median(r[2] for r in rs):>13.2f}{max(r[3] for r in rs):>11.4f}"
        )

    kernels = {}
    for mode in MODES:
        step(mode, marked=True)  # the profiler's own first-use costs stay out of the profiled step
        torch.cuda.synchronize()  # and the GPU is idle when the profiled step begins
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(mode, marked=True)
            torch.cuda.synchronize()
        kernels[mode] = _kernels(prof)
    print(
        f"\n{'mode':<20}{'mark to 1st':>12}{'to graph':>10}{'fwd busy':>10}{'fwd idle':>10}{'bwd busy':>10}"
        f"{'bwd idle':>10}   (ms)"
    )
    for mode, (forward, backward, mark_end) in kernels.items():
        first_graph = next(k for k in forward if k["name"].startswith("triton_"))
        print(
            f"{mode:<20}{(forward[0]['ts'] - mark_end) / 1e3:>12.3f}{(first_graph['ts'] - mark_end) / 1e3:>10.3f}"
            f"{_busy(forward):>10.2f}{_idle(forward):>10.2f}{_busy(backward):>10.2f}{_idle(backward):>10.2f}"
        )
    print(f"\nthe {GAPS} longest idle gaps of each part: start (ms after the part's first kernel), length, between")
    for mode, (forward, backward, _) in kernels.items():
        for part, part_kernels in (("forward", forward), ("backward", backward)):
            for start, gap, before, after in _gaps(part_kernels):
                print(f"  {mode:<20}{part:<9}{start:>8.3f} ms {gap:>7.0f} us  {before[:40]} -> {after[:40]}")
    print("\nkernels whose time differs by more than 20 us (dense -> bitsparse, count and ms):")
    for part, index in (("forward", 0), ("backward", 1)):
        dense, sparse = (_by_name(kernels[mode][index]) for mode in MODES)
        diffs = [(sparse.get(n, (0, 0))[1] - dense.get(n, (0, 0))[1], n) for n in dense.keys() | sparse.keys()]
        for diff, name in sorted((d for d in diffs if abs(d[0]) > 20), reverse=True):
            (dc, dt), (sc, st) = dense.get(name, (0, 0)), sparse.get(name, (0, 0))
            print(f"  {part:<9}{diff / 1e3:>+8.3f}  {name[:64]:<64} {dc:>3}x {dt / 1e3:.3f} -> {sc:>3}x {st / 1e3:.3f}")


def _kernels(prof) -> tuple[list, list, float]:
    """The forward's and the backward's kernels of a profiled marked step, and the end of the
    first mark (in the trace's microseconds)."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
        key=lambda e: e["ts"],
    )
    first, second = (i for i, e in enumerate(gpu) if MARK in e["name"])
    return gpu[first + 1 : second], gpu[second + 1 :], gpu[first]["ts"] + gpu[first]["dur"]


def _busy(kernels: list) -> float:
    return sum(k["dur"] for k in kernels) / 1e3


def _idle(kernels: list) -> float:
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    return span / 1e3 - _busy(kernels)


def _gaps(kernels: list) -> list[tuple[float, float, str, str]]:
    """The ``GAPS`` longest stretches without a kernel: their start (ms from the first kernel),
    length (us) and the kernels before and after, in time order."""
    origin = kernels[0]["ts"]
    gaps = [
        ((a["ts"] + a["dur"] - origin) / 1e3, b["ts"] - a["ts"] - a["dur"], a["name"], b["name"])
        for a, b in zip(kernels, kernels[1:])
    ]
    return sorted(sorted(gaps, key=lambda g: -g[1])[:GAPS])


def _by_name(kernels: list) -> dict:
    totals = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        totals[k["name"]][0] += 1
        totals[k["name"]][1] += k["dur"]
    return {name: tuple(total) for name, total in totals.items()}


if __name__ == "__main__":
    main()
