"""The ``hooks`` suite: the host time BitSparse's saved-tensor hooks add per saved tensor.

Two chains of ``--tensors`` elementwise ops on a tensor of ``--numel`` elements (bfloat16 on
CUDA, float32 on the CPU), each op saving its output for backward: ``stored`` applies ``relu``
to a tensor with 90% zeros (every output is compressed), ``skipped`` applies ``tanh`` (every
output is screened and kept as it is). Each chain runs as plain autograd, under a pair of
Python hooks that return their argument (``identity hooks``: what calling any Python hook
costs) and under ``bitsparse.compressing()``, in interleaved rounds after warm-up steps.

Per saved tensor, against plain autograd: the host time added to the forward (queueing its
ops) and to the backward (``backward()`` returning), medians over the rounds; and the GPU time
added to the step. The GPU time is measured with the host far ahead: the step is queued behind
a sleeping kernel, so the events time the kernels alone, not the host's pace (BitSparse's
arena, whose value region goes on in host memory, is sure of room for every store: the host
never waits for an encoder's report).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time

import torch

import bitsparse

MODES = ("plain", "identity hooks", "bitsparse")
CHAINS = {"stored": torch.relu, "skipped": torch.tanh}
SLEEP_CYCLES_PER_MS = 2_000_000
"""``torch.cuda._sleep`` cycles per millisecond, about (a GPU clock near 2 GHz); the sleep
only has to outlast the host's queueing of the step, so it is taken twice as long."""


def _context(mode: str, options: dict):
    if mode == "identity hooks":
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    if mode == "bitsparse":
        return bitsparse.compressing(**options)
    return contextlib.nullcontext()


def chain_step(op, x: torch.Tensor, tensors: int, context) -> tuple[float, float]:
    """One forward of ``tensors`` applications of ``op`` under ``context``, and its backward;
    the host's time for each, in seconds."""
    start = time.perf_counter()
    with context:
        h = x
        for _ in range(tensors):
            h = op(h)
    forward = time.perf_counter() - start
    h.backward(torch.ones_like(h))
    return forward, time.perf_counter() - start - forward


def gpu_ms(step, host_ms: float) -> float:
    """GPU time of ``step()`` in ms, queued behind a sleeping kernel that outlasts the host."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2 * host_ms * SLEEP_CYCLES_PER_MS))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def measure(chain: str, args: argparse.Namespace, options: dict) -> dict[str, dict[str, float]]:
    """Median host (forward, backward) and GPU times per mode, in ms, for one chain."""
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    device = "cuda" if cuda else "cpu"
    x = torch.relu(torch.randn(args.numel, device=device) - 1.28).to(dtype).requires_grad_()
    op = CHAINS[chain]

    def step(mode: str) -> tuple[float, float]:
        return chain_step(op, x, args.tensors, _context(mode, options))

    for _ in range(args.warmup):
        for mode in MODES:
            step(mode)
    samples: dict[str, list] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            if cuda:
                torch.cuda.synchronize()
            forward, backward = step(mode)
            if cuda:
                gpu = gpu_ms(lambda: step(mode), 1000 * (forward + backward))
            else:
                gpu = float("nan")
            samples[mode].append((1000 * forward, 1000 * backward, gpu))
    if args.profile and chain in args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [step("bitsparse") for _ in range(args.repeats)])
        print(f"cProfile of {args.repeats} bitsparse steps of the {chain} chain, by own time:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return {
        mode: {
            key: statistics.median(s[i] for s in samples[mode]) for i, key in enumerate(("forward", "backward", "gpu"))
        }
        for mode in MODES
    }


def run(args: argparse.Namespace) -> list[dict]:
    options = {"min_numel": min(args.numel, 1 << 16)}
    rows = []
    print(
        f"hooks: {args.tensors} saved tensors of {args.numel} elements per step, medians of {args.repeats} "
        "interleaved rounds; us per saved tensor added to plain autograd's"
    )
    print(f"  {'chain':<8}{'mode':<16}{'fwd host':>10}{'bwd host':>10}{'GPU':>10}   plain: fwd, bwd, GPU us/tensor")
    for chain in CHAINS:
        times = measure(chain, args, options)
        plain = times["plain"]
        for mode in MODES[1:]:
            added = {key: 1000 * (times[mode][key] - plain[key]) / args.tensors for key in plain}
            base = "   ".join(f"{1000 * plain[key] / args.tensors:.1f}" for key in plain)
            print(
                f"  {chain:<8}{mode:<16}{added['forward']:>10.1f}{added['backward']:>10.1f}{added['gpu']:>10.1f}"
                f"   {base}"
            )
            rows.append({"chain": chain, "mode": mode, **{f"added_{k}_us": v for k, v in added.items()}})
    print(bitsparse.stats())
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensors", type=int, default=200, help="saved tensors per step")
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements per saved tensor")
    parser.add_argument("--repeats", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--profile", nargs="*", choices=tuple(CHAINS), help="print a cProfile of these chains")
