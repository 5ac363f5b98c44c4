"""Training-step comparisons: the same forward+backward under different activation strategies.

Modes: ``dense`` (plain autograd), ``checkpoint`` (non-reentrant checkpointing around each MLP),
``offload`` (``torch.autograd.graph.save_on_cpu(pin_memory=True)``), ``bitsparse`` and
``bitsparse-15bit`` (``bitsparse.compressing()``, without and with sign packing), and
``compiled-dense``, ``compiled-checkpoint`` and ``compiled-bitsparse``, the same under
``torch.compile`` (of the whole forward, or of each block: ``--compile-scope``). Gradients of a
compiled mode are compared with ``compiled-dense``'s, those of the others with ``dense``'s.

Memory is the peak allocated during a step above what was allocated before its forward,
counting the BitSparse arena at its full capacity. Times are medians over interleaved repeats
(mode after mode, round after round), so drifts in clock or temperature hit every mode alike:
the step's (CUDA events around forward and backward) and the host's time to run the forward.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

import bitsparse
from bitsparse.bench.models import shift_to_sparsity

MODES = (
    "dense", "checkpoint", "offload", "bitsparse", "bitsparse-15bit",
    "compiled-dense", "compiled-checkpoint", "compiled-bitsparse",
)  # fmt: skip
COMPILE_SCOPES = ("model", "block")
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_kernels():
    """Deterministic kernels inside the block, for comparing gradients bit for bit.

    Turns on ``torch.use_deterministic_algorithms`` (warning only) and sets
    ``CUBLAS_WORKSPACE_CONFIG``, which cuBLAS needs to be deterministic; both are restored on
    exit. Never time steps inside: PyTorch 2.11 reads the variable on every matrix product,
    which cost 40 us of host time per product and 110 us per linear layer with a bias on the
    H200's host, enough to make a GPT step host-bound (docs/benchmarks.md).
    """
    enabled = torch.are_deterministic_algorithms_enabled()
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC_WORKSPACE
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled)
        if workspace is None:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


def arena_outside_allocator(stats: bitsparse.Stats) -> int:
    """The device memory of a BitSparse arena that ``stats`` describe, where it is mapped
    outside PyTorch's caching allocator (``Options.host_spill``), which
    ``torch.cuda.max_memory_allocated()`` leaves out; 0 where the allocator holds it."""
    return stats.arena_reserved if stats.spill_reserved else 0


def max_memory_allocated() -> int:
    """The CUDA peak of allocated memory since the last reset, plus ``arena_outside_allocator``."""
    return torch.cuda.max_memory_allocated() + arena_outside_allocator(bitsparse.stats())


def bitsparse_options(args: argparse.Namespace) -> dict:
    """The options of the BitSparse modes: ``--window``, ``--no-host-spill``, and for
    ``--quick`` models (whose tensors are small) ``min_numel=1024``, so that they are
    compressed anyway."""
    options = {"window": args.window, "host_spill": args.host_spill}
    return {**options, **({"min_numel": 1024} if args.quick else {})}


def window_argument(text: str) -> int | None:
    """``--window``'s value: an int, or "none" (no count)."""
    return None if text == "none" else int(text)


def add_bitsparse_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the BitSparse modes, read by ``bitsparse_options``."""
    parser.add_argument(
        "--window", type=window_argument, default=1, help="BitSparse's window option, for its modes (or 'none')"
    )
    parser.add_argument(
        "--no-host-spill", dest="host_spill", action="store_false", help="BitSparse's modes with host_spill=False"
    )


def mode_context(mode: str, **bitsparse_options):
    if mode == "offload":
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    if mode in ("bitsparse", "compiled-bitsparse"):
        return bitsparse.compressing(**bitsparse_options)
    if mode == "bitsparse-15bit":
        return bitsparse.compressing(sign_pack=True, **bitsparse_options)
    return contextlib.nullcontext()


@dataclass
class ModeResult:
    mode: str
    tokens: int
    activation_mib: float
    mib_per_token: float
    step_ms: float
    step_ms_spread: float
    forward_host_ms: float
    """The host's time to run (queue) the forward: where it nears the forward's GPU time,
    the host sets the step's pace."""
    overhead_pct: float
    grads_equal_dense: bool | None
    compression_ratio: float | None


class _Compiled(torch.nn.Module):
    """A module that runs compiled while ``on``, as it is otherwise (one set of parameters)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.eager, self.compiled, self.on = module, torch.compile(module, dynamic=False), False

    def forward(self, *args):
        return (self.compiled if self.on else self.eager)(*args)


def compiled(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], scope: str) -> Callable[[], torch.Tensor]:
    """``loss_fn`` under ``torch.compile``: its whole forward (``scope="model"``), or each of
    ``model.units()`` (``"block"``), which then run compiled only within the returned function.
    Each size compiles its own graphs (``dynamic=False``), as a training run of one size does:
    the compiled code of earlier models is dropped first, since dynamo keeps a few graphs per
    function only (``recompile_limit``) and runs the function eagerly past them."""
    torch._dynamo.reset()
    if scope == "model":
        return torch.compile(loss_fn, dynamic=False)
    units = model.units()
    switches = [_Compiled(unit) for unit in units]
    for i, switch in enumerate(switches):
        units[i] = switch

    def run() -> torch.Tensor:
        for switch in switches:
            switch.on = True
        try:
            return loss_fn()
        finally:
            for switch in switches:
                switch.on = False

    return run


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


# A compiled mode that dynamo would run eagerly (past its recompile limit) raises rather than
# being timed as compiled.
@torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
def compare_modes(
    model: torch.nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    tokens: int,
    modes=MODES,
    repeats: int = 10,
    warmup: int = 3,
    bitsparse_options: dict | None = None,
    compile_scope: str = "model",
) -> list[ModeResult]:
    """Run one step of ``loss_fn().backward()`` per mode and round; measure memory and time."""
    cuda = torch.cuda.is_available()
    device_sync = torch.cuda.synchronize if cuda else (lambda: None)
    compiled_loss_fn = None
    if any(mode.startswith("compiled") for mode in modes):
        compiled_loss_fn = compiled(model, loss_fn, compile_scope)

    def step(mode: str) -> float:
        """One step; the host's time to run (queue) its forward, in ms."""
        model.set_checkpointing(mode.endswith("checkpoint"))
        start = time.perf_counter()
        with mode_context(mode, **(bitsparse_options or {})):
            loss = (compiled_loss_fn if mode.startswith("compiled") else loss_fn)()
        forward_ms = 1000 * (time.perf_counter() - start)
        loss.backward()
        model.set_checkpointing(False)
        return forward_ms

    for _ in range(warmup):
        for mode in modes:
            step(mode)
    model.zero_grad(set_to_none=False)

    memory, grads, ratios = {}, {}, {}
    # Gradients are compared bit for bit, which needs deterministic kernels.
    with deterministic_kernels():
        for mode in modes:
            model.zero_grad(set_to_none=False)
            device_sync()
            # The arena counts whole. Allocated by PyTorch before the step, it is in `base`; mapped
            # outside PyTorch, the peak leaves it out, and the arena the step ends with counts (a
            # step maps the arena that the step before it planned).
            uses_arena = "bitsparse" in mode
            before = bitsparse.stats() if uses_arena else None
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            step(mode)
            device_sync()
            arena = 0
            if uses_arena:
                after = bitsparse.stats()
                ratios[mode] = after.ratio
                arena = before.arena_reserved - arena_outside_allocator(before) + arena_outside_allocator(after)
            if cuda:
                memory[mode] = torch.cuda.max_memory_allocated() - base + arena
            grads[mode] = _grads(model)

    times: dict[str, list[float]] = {mode: [] for mode in modes}
    forward_host: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:
            model.zero_grad(set_to_none=False)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                forward_host[mode].append(step(mode))
                end.record()
                end.synchronize()
                times[mode].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                forward_host[mode].append(step(mode))
                times[mode].append(1000 * (time.perf_counter() - t0))

    # Some CUDA backward kernels (cuDNN attention) are nondeterministic even so: only when two
    # dense steps agree do other modes' gradients get compared. A compiled mode is compared
    # with compiled-dense (compiled kernels may round differently), and timed against it.
    references = {}
    for baseline in ("dense", "compiled-dense"):
        if baseline in grads:
            model.zero_grad(set_to_none=False)
            with deterministic_kernels():
                step(baseline)
            if all(torch.equal(a, b) for a, b in zip(grads[baseline], _grads(model))):
                references[baseline] = grads[baseline]
    results = []
    for mode in modes:
        baseline = "compiled-dense" if mode.startswith("compiled") else "dense"
        dense_ms = statistics.median(times[baseline]) if baseline in times else None
        ms = statistics.median(times[mode])
        quartiles = statistics.quantiles(times[mode], n=4) if len(times[mode]) > 1 else [ms, ms, ms]
        mib = memory.get(mode, float("nan")) / 2**20
        reference = references.get(baseline)
        equal = None
        if reference is not None:
            equal = len(reference) == len(grads[mode]) and all(
                torch.equal(a, b) for a, b in zip(reference, grads[mode])
            )
        results.append(
            ModeResult(
                mode=mode,
                tokens=tokens,
                activation_mib=mib,
                mib_per_token=mib / tokens,
                step_ms=ms,
                step_ms_spread=quartiles[2] - quartiles[0],
                forward_host_ms=statistics.median(forward_host[mode]),
                overhead_pct=100 * (ms / dense_ms - 1) if dense_ms else float("nan"),
                grads_equal_dense=equal,
                compression_ratio=ratios.get(mode),
            )
        )
    return results


def print_table(title: str, results: list[ModeResult]) -> None:
    print(title)
    print(
        f"  {'mode':<20}{'MiB':>10}{'MiB/token':>11}{'ms':>9}{'IQR':>7}{'fwd host':>9}{'vs dense':>10}"
        f"{'ratio':>7}  grads"
    )
    for r in results:
        ratio = f"{r.compression_ratio:.2f}" if r.compression_ratio else "-"
        grads = {True: "equal", False: "DIFFER", None: "-"}[r.grads_equal_dense]
        print(
            f"  {r.mode:<20}{r.activation_mib:>10.0f}{r.mib_per_token:>11.4f}{r.step_ms:>9.1f}"
            f"{r.step_ms_spread:>7.1f}{r.forward_host_ms:>9.1f}{r.overhead_pct:>+9.1f}%{ratio:>7}  {grads}"
        )


def write_csv(path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def as_rows(results: list[ModeResult], **labels) -> list[dict]:
    return [{**labels, **asdict(r)} for r in results]


def largest_fitting(rows: list[dict], size_key: str, budget_bytes: float, static_bytes: float) -> None:
    """Add ``fits_budget``: the largest size whose activations fit the budget, per row.

    Activation memory grows linearly with tokens, so it is extrapolated from the row's own
    measurement: ``(budget - static) / (bytes per token)`` tokens, in units of ``size_key``.
    """
    for row in rows:
        per_token = row["mib_per_token"] * 2**20
        tokens_per_unit = row["tokens"] / row[size_key]
        fits = (budget_bytes - static_bytes) / per_token / tokens_per_unit if per_token > 0 else float("nan")
        row["fits_budget"] = int(fits) if fits == fits else None


def plot_suite(path: str, rows: list[dict], size_key: str, title: str) -> None:
    """Memory per token and step time against ``size_key``, one line per mode and zero level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (mode, zeros), group in _groups(rows).items():
        sizes = [r[size_key] for r in group]
        style = "-" if zeros == "init" else "--"
        label = f"{mode} ({zeros} zeros)"
        memory.plot(sizes, [r["mib_per_token"] for r in group], style, marker="o", label=label)
        time.plot(sizes, [r["step_ms"] for r in group], style, marker="o", label=label)
    memory.set_ylabel("activation memory (MiB per token)")
    time.set_ylabel("step time (ms, median)")
    for axis in (memory, time):
        axis.set_xlabel(size_key)
        axis.grid(alpha=0.3)
    time.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run_suite(args, name: str, size_key: str, sizes, build, title: str) -> list[dict]:
    """Compare the modes at every size and zero level; print, and write ``<name>.csv/.png``.

    ``build(size)`` returns ``(model, loss_fn, tokens)`` for a fresh model of that size.
    """
    rows = []
    cuda = torch.cuda.is_available()
    for zeros in args.zeros:
        for size in sizes:
            torch.manual_seed(0)
            model, loss_fn, tokens = build(size)
            if zeros is not None:
                shift_to_sparsity(model, loss_fn, zeros)
            static = torch.cuda.memory_allocated() if cuda else 0
            results = compare_modes(
                model, loss_fn, tokens, args.modes, args.repeats, args.warmup, bitsparse_options(args),
                args.compile_scope,
            )  # fmt: skip
            label = "init" if zeros is None else f"{round(100 * zeros)}%"
            print_table(f"{name} {size_key}={size}, MLP zeros {label}", results)
            size_rows = as_rows(results, suite=name, **{size_key: size}, zeros=label)
            if args.budget_gib:
                largest_fitting(size_rows, size_key, args.budget_gib * 2**30, static)
            rows += size_rows
            del model, loss_fn
            if cuda:
                torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, f"{name}.csv"), rows)
    plot_suite(os.path.join(args.out, f"{name}.png"), rows, size_key, title)
    if args.budget_gib:
        print(f"largest {size_key} within {args.budget_gib} GiB (linear extrapolation per mode):")
        for row in rows:
            print(f"  {row['zeros']:>5} zeros  {row['mode']:<16} {row['fits_budget']}")
    return rows


def add_common_arguments(parser, zeros_default) -> None:
    parser.add_argument("--zeros", type=lambda s: None if s == "init" else float(s), nargs="+",
                        default=zeros_default, help="MLP zero fractions ('init' = as initialised)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--compile-scope", default="model", choices=COMPILE_SCOPES,
                        help="what the compiled modes compile: the whole forward, or each block")
    parser.add_argument("--repeats", type=int, default=10, help="interleaved timing rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--budget-gib", type=float, help="also report the largest size that fits")
    add_bitsparse_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="a tiny version that runs on the CPU")
    parser.add_argument("--out", default=".", help="folder for the CSV and PNG")


def _groups(rows: list[dict]) -> dict:
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["mode"], row["zeros"]), []).append(row)
    return groups
