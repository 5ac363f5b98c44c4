"""The ``pipeline`` suite: one stage of a pipeline-parallel schedule, dense and with BitSparse.

A stage runs ``--microbatches`` forwards and backwards an iteration in the order of
``one_f_one_b``: up to ``in_flight`` microbatches wait for their backward at once, so as many
of BitSparse's steps overlap (each is served by an arena of its own). The stage is an
``MLPStack`` (ReLU^2 MLPs, bfloat16) whose MLPs are shifted to ``--zeros``; each forward runs
inside ``bitsparse.compressing()`` in the BitSparse mode.

For each zero level and number in flight, in one process: the peak of allocated memory of
each of the first iterations, everything the process holds included (model, gradients,
inputs, arenas: ``IterationMonitor``), dense and then with BitSparse from its first iteration
on (*steady*: the most of the iterations after the first; the *activation ratio*: the steady
peak over dense's, each less what the process holds between iterations); the most waits of
the host for the GPU (``Stats.window_waits``) in one of those iterations; whether every
BitSparse iteration's gradients equal dense's bit for bit; how many tensors the last step
compressed and how many were kept (``Stats.fallbacks``); and the iteration's time (CUDA
events) and its host time (to queue the last backward), medians over interleaved rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Callable

import torch

import bitsparse
from bitsparse.bench import training
from bitsparse.bench.models import MLPStack, shift_to_sparsity

MODES = ("dense", "bitsparse")


def one_f_one_b(microbatches: int, in_flight: int) -> list[tuple[str, int]]:
    """A pipeline stage's schedule (1F1B): ``in_flight`` forwards, then a backward and a
    forward by turns, then the last backwards; ``("F", i)`` runs microbatch ``i``'s forward,
    ``("B", i)`` its backward."""
    if not 1 <= in_flight <= microbatches:
        raise ValueError(f"in_flight={in_flight} must be between 1 and microbatches={microbatches}")
    schedule = [("F", i) for i in range(in_flight)]
    for i in range(in_flight, microbatches):
        schedule += [("B", i - in_flight), ("F", i)]
    return schedule + [("B", i) for i in range(microbatches - in_flight, microbatches)]


def run_iteration(
    model: torch.nn.Module,
    inputs: list[torch.Tensor],
    schedule: list[tuple[str, int]],
    context: Callable[[], contextlib.AbstractContextManager],
    after_each: Callable[[str, int], None] = lambda op, i: None,
) -> None:
    """One iteration of ``schedule`` over ``inputs``: each forward inside ``context()``, and
    ``after_each(op, i)`` after every forward (``"F"``) and backward (``"B"``) of microbatch
    ``i``, or after its graph is dropped without one (``"D"``, a skipped microbatch); the
    gradients accumulate into the model's."""
    losses = {}
    for op, i in schedule:
        if op == "B":
            losses.pop(i).backward()
        elif op == "D":
            del losses[i]
        else:
            with context():
                losses[i] = model(inputs[i])
        after_each(op, i)


class PerForward:
    """What each forward added to a count that ``bitsparse.stats()`` keeps per step: a step's
    forwards follow one another without a backward between, and their counts add up."""

    def __init__(self, count: Callable[[bitsparse.Stats], int]):
        self._count, self._step, self._seen = count, None, 0

    def added(self, stats: bitsparse.Stats) -> int:
        """What the forward that ``stats`` were read after added (read after each forward)."""
        value = self._count(stats)
        added = value - (self._seen if stats.step == self._step else 0)
        self._step, self._seen = stats.step, value
        return added


class IterationMonitor:
    """Called after each op of an iteration: the iteration's ``peak`` of allocated memory on
    CUDA, each op's counted with the arenas mapped outside PyTorch's allocator as the op
    leaves them (an arena is made or resized as a step begins, at a forward), and the host's
    ``waits`` for the GPU (``Stats.window_waits``) added up over the iteration's steps; with
    ``arenas`` False (dense), the peak alone."""

    def __init__(self, arenas: bool):
        self.peak, self.waits = 0, 0
        self._arenas, self._waits = arenas, PerForward(lambda stats: stats.window_waits)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def __call__(self, op: str, i: int) -> None:
        stats = bitsparse.stats() if self._arenas else None
        if torch.cuda.is_available():
            mapped = training.arena_outside_allocator(stats) if self._arenas else 0
            self.peak = max(self.peak, torch.cuda.max_memory_allocated() + mapped)
            torch.cuda.reset_peak_memory_stats()
        if self._arenas and op == "F":
            self.waits += self._waits.added(stats)


def build(args: argparse.Namespace, device: str):
    """``(model, inputs)``: a seeded stage and its microbatches, not yet shifted to sparsity."""
    torch.manual_seed(0)
    dim, hidden, layers, rows = (64, 256, 2, 64) if args.quick else (args.dim, args.hidden, args.layers, args.rows)
    dtype = torch.float32 if args.quick else torch.bfloat16
    model = MLPStack(dim, hidden, layers).to(device=device, dtype=dtype)
    inputs = [torch.randn(rows, dim, device=device, dtype=dtype) for _ in range(args.microbatches)]
    return model, inputs


def measure(model, inputs, schedule, args: argparse.Namespace) -> dict:
    """One configuration's row: peaks, waits, gradients and times (see the module's docstring)."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    options = training.bitsparse_options(args)
    contexts = {"dense": contextlib.nullcontext, "bitsparse": lambda: bitsparse.compressing(**options)}

    def monitored(mode: str) -> IterationMonitor:
        model.zero_grad(set_to_none=False)
        sync()
        monitor = IterationMonitor(arenas=mode == "bitsparse")
        run_iteration(model, inputs, schedule, contexts[mode], monitor)
        return monitor

    def grads() -> list[torch.Tensor]:
        # On the host: a copy on the device would count in the peaks of the iterations after it.
        return [p.grad.cpu() for p in model.parameters()]

    bitsparse.reset()
    monitored("dense")  # allocates the gradients
    static = torch.cuda.memory_allocated() if cuda else 0
    with training.deterministic_kernels():
        dense_peak = monitored("dense").peak
        expected = grads()
        bitsparse_peaks, waits, exact = [], [], True
        for _ in range(args.iterations):
            monitor = monitored("bitsparse")
            bitsparse_peaks.append(monitor.peak)
            waits.append(monitor.waits)
            exact = exact and all(torch.equal(a, b) for a, b in zip(grads(), expected))
    stats = bitsparse.stats()

    times = {mode: [] for mode in MODES}
    host = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            model.zero_grad(set_to_none=False)
            sync()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            began = time.perf_counter()
            run_iteration(model, inputs, schedule, contexts[mode])
            host[mode].append(1000 * (time.perf_counter() - began))
            if cuda:
                end.record()
                end.synchronize()
                times[mode].append(start.elapsed_time(end))
            else:
                times[mode].append(host[mode][-1])
    dense_ms, bitsparse_ms = (statistics.median(times[mode]) for mode in MODES)
    steady_peak = max(bitsparse_peaks[1:], default=bitsparse_peaks[0])
    return {
        "dense_peak_bytes": dense_peak,
        "first_peak_bytes": bitsparse_peaks[0],
        "steady_peak_bytes": steady_peak,
        "activation_ratio": _ratio(steady_peak - static, dense_peak - static),
        "waits_per_iteration": max(waits[1:], default=waits[0]),
        "grads_equal_dense": exact,
        "last_step_compressed": stats.tensors_compressed,
        "fallbacks": sum(stats.fallbacks.values()),
        "dense_ms": dense_ms,
        "bitsparse_ms": bitsparse_ms,
        "overhead_pct": 100 * (bitsparse_ms / dense_ms - 1),
        "dense_host_ms": statistics.median(host["dense"]),
        "bitsparse_host_ms": statistics.median(host["bitsparse"]),
    }


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else float("nan")


def run(args: argparse.Namespace) -> list[dict]:
    """Every zero level and number in flight; print a table, write ``pipeline.csv``.

    Raises:
        ValueError: ``--iterations`` below 1, or a number in flight outside 1 to
            ``--microbatches``.
    """
    if args.iterations < 1:
        raise ValueError(f"--iterations {args.iterations}: at least one BitSparse iteration must be measured")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, inputs = build(args, device)
    rows = []
    print(
        f"pipeline stage: {len(model.layers)} x MLP, {len(inputs)} microbatches of {inputs[0].shape[0]} rows, "
        f"{inputs[0].dtype}; peaks in MiB (all allocated memory), times in ms (medians of {args.repeats})"
    )
    print(
        f"{'zeros':>5} {'in flight':>9} {'dense':>9} {'first':>9} {'steady':>9} {'act. ratio':>10} {'waits':>6} "
        f"{'dense ms':>9} {'bs ms':>8} {'vs dense':>9} {'host: dense':>11} {'bs':>6} {'stored':>6} {'kept':>5}  grads"
    )
    for zeros in args.zeros:
        shift_to_sparsity(model, lambda: model(inputs[0]), zeros)
        for in_flight in args.in_flight:
            row = {"zeros": zeros, "in_flight": in_flight}
            row.update(measure(model, inputs, one_f_one_b(len(inputs), in_flight), args))
            rows.append(row)
            mib = 2**20
            print(
                f"{zeros:>5.2f} {in_flight:>9} {row['dense_peak_bytes'] / mib:>9.0f} "
                f"{row['first_peak_bytes'] / mib:>9.0f} {row['steady_peak_bytes'] / mib:>9.0f} "
                f"{row['activation_ratio']:>10.3f} {row['waits_per_iteration']:>6} {row['dense_ms']:>9.1f} "
                f"{row['bitsparse_ms']:>8.1f} {row['overhead_pct']:>+8.1f}% "
                f"{row['dense_host_ms']:>11.1f} {row['bitsparse_host_ms']:>6.1f} "
                f"{row['last_step_compressed']:>6} {row['fallbacks']:>5}  "
                f"{'equal' if row['grads_equal_dense'] else 'DIFFER'}"
            )
    os.makedirs(args.out, exist_ok=True)
    training.write_csv(os.path.join(args.out, "pipeline.csv"), rows)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zeros", type=float, nargs="+", default=[0.5, 0.7, 0.9], help="MLP zero fractions")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 2, 3, 4], help="microbatches in flight")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8192, help="tokens per microbatch")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=4, help="iterations whose peaks are measured")
    parser.add_argument("--repeats", type=int, default=10, help="interleaved timing rounds")
    parser.add_argument("--quick", action="store_true", help="a tiny stage that runs on the CPU")
    parser.add_argument("--out", default=".", help="folder for pipeline.csv")
    training.add_bitsparse_arguments(parser)
