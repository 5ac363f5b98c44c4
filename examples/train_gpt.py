"""Train a small GPT on the Python standard library's own source, with BitSparse.

The model is in the style of Modded-NanoGPT (RMSNorm, rotary embeddings, QK-norm, a ReLU^2
MLP written as ``fc(x).relu_().square()``) and is unchanged: only the forward pass is wrapped
in ``bitsparse.compressing()``. The text is the ``.py`` files of the running interpreter's
standard library, read as bytes (a vocabulary of 256), so nothing is downloaded.

    python examples/train_gpt.py                  # tiny on the CPU (under 2 minutes), larger on CUDA
    python examples/train_gpt.py --steps 50 --plot training.png
    torchrun --nproc-per-node 2 examples/train_gpt.py --ddp   # data-parallel, one GPU per process

The first step checks that the gradients with and without BitSparse are identical. With
``--ddp`` every process trains a DistributedDataParallel replica on its own shard of the text
(NCCL on CUDA, gloo on the CPU) with BitSparse's hooks in the same place, and process 0 prints.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

import bitsparse
from bitsparse.bench.distributed import init_from_torchrun, leaving_process_group
from bitsparse.bench.models import GPT, GPTConfig
from bitsparse.bench.training import deterministic_kernels

CONFIGS = {
    # name: (model, sequence length, batch size, steps, learning rate)
    "tiny": (GPTConfig(layers=2, dim=64, heads=2, head_dim=32, hidden=256, vocab=256, qk_norm=True), 128, 8, 40, 3e-3),
    "small": (
        GPTConfig(layers=6, dim=384, heads=6, head_dim=64, hidden=1536, vocab=256, qk_norm=True),
        1024,
        16,
        300,
        1e-3,
    ),
}


def standard_library_bytes(limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's ``.py`` files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    if size == 0:
        raise SystemExit(f"no Python sources found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batches(data: torch.Tensor, length: int, batch: int, device, generator: torch.Generator):
    """Endless random windows of ``length + 1`` bytes: inputs and next-byte targets."""
    while True:
        starts = torch.randint(len(data) - length - 1, (batch,), generator=generator)
        window = torch.stack([data[s : s + length + 1] for s in starts.tolist()]).to(device)
        yield window[:, :-1], window[:, 1:]


def gradients(model, tokens, targets, compressed: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if compressed:
        with bitsparse.compressing(min_numel=1024):
            loss = model(tokens, targets)
    else:
        loss = model(tokens, targets)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def check_gradients(model, tokens, targets) -> str:
    """Compare a step's gradients with and without BitSparse, bit for bit: two steps with it,
    the first of which only measures what it would store, and the second stores it."""
    with deterministic_kernels():
        plain = gradients(model, tokens, targets, compressed=False)
        again = gradients(model, tokens, targets, compressed=False)
        compressed = [gradients(model, tokens, targets, compressed=True) for _ in range(2)]
    if not all(torch.equal(a, b) for a, b in zip(plain, again)):
        return "not compared: two plain runs already differ on this device (nondeterministic kernels)"
    if not all(torch.equal(a, b) for step in compressed for a, b in zip(plain, step)):
        raise SystemExit("gradients with and without BitSparse differ: please report this")
    return "identical with and without BitSparse (bit for bit)"


def mean_over_processes(value: torch.Tensor) -> float:
    """``value`` (a one-element tensor) averaged over the processes of the default group; waits
    for the device."""
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def progress(step: int, total: int, width: int = 20) -> str:
    done = width * step // total
    return f"[{'#' * done}{'.' * (width - done)}] {step:>{len(str(total))}}/{total}"


def plot(path: str, losses: list[float], zeros: list[float]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    steps = range(1, len(losses) + 1)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, losses)
    top.set_ylabel("training loss (nats/byte)")
    bottom.plot(steps, [100 * z for z in zeros], color="tab:orange")
    bottom.set_ylabel("MLP zeros (%)")
    bottom.set_xlabel("step")
    figure.suptitle("GPT on the Python standard library, with bitsparse.compressing()")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    """Train as the command line ``argv`` says; the run's summary (losses, median step time, MLP
    zeros, compression ratio). With ``--ddp``, in the process group torchrun describes, which
    is left at the end.

    Raises:
        SystemExit: bad arguments, ``--ddp`` without torchrun, or gradients that differ with
            and without BitSparse.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=CONFIGS, help="default: tiny on the CPU, small on CUDA")
    parser.add_argument("--steps", type=int, help="training steps (default: the config's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of loss and MLP zeros")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ddp", action="store_true", help="data-parallel over the processes torchrun starts")
    args = parser.parse_args(argv)
    if not args.ddp:
        return train(args, torch.device(args.device))
    device = init_from_torchrun(torch.device(args.device).type)
    with leaving_process_group():
        return train(args, device)


def train(args: argparse.Namespace, device: torch.device) -> dict:
    """Train as ``args`` say on ``device``, with ``--ddp`` in the process group ``main`` joined;
    the summary ``main`` returns."""
    rank, processes = (dist.get_rank(), dist.get_world_size()) if args.ddp else (0, 1)

    def say(*line: str) -> None:
        if rank == 0:
            print(*line, flush=True)

    config, length, batch, steps, lr = CONFIGS[args.config or ("small" if device.type == "cuda" else "tiny")]
    steps = args.steps or steps
    torch.manual_seed(args.seed)
    data = standard_library_bytes(limit=8 << 20)
    model = GPT(config).to(device)
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    shard = data.tensor_split(processes)[rank]
    stream = batches(shard, length, batch, device, torch.Generator().manual_seed(args.seed))
    where = f"on {processes} processes (DDP, {dist.get_backend()}), " if args.ddp else ""
    say(
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {device}, {where}"
        f"{len(data) / 1e6:.1f} MB of standard-library source, batch {batch} x {length} bytes"
        + (" per process (statistics: process 0's)" if args.ddp else "")
    )

    tokens, targets = next(stream)
    # Under DDP the compared gradients are all-reduced: every process reaches the same verdict.
    say(f"gradients: {check_gradients(model, tokens, targets)}")

    losses, zeros, times = [], [], []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with bitsparse.compressing(min_numel=1024):
            loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        # Waits for the step: the time below is the whole step's.
        value = mean_over_processes(loss) if args.ddp else loss.item()
        elapsed = time.perf_counter() - start
        stats = bitsparse.stats()
        losses.append(value)
        zeros.append(stats.zero_fraction)
        times.append(elapsed)
        say(
            f"{progress(step, steps)}  loss {value:.3f}  {1000 * elapsed:6.1f} ms  "
            f"MLP zeros {100 * stats.zero_fraction:4.1f}%  | {stats}"
        )
        tokens, targets = next(stream)

    summary = {
        "steps": steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "median_step_ms": 1000 * sorted(times)[len(times) // 2],
        "final_zero_fraction": zeros[-1],
        "compression_ratio": stats.ratio,
    }
    say(
        f"done: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} over {steps} steps, "
        f"median step {summary['median_step_ms']:.1f} ms, MLP zeros {100 * zeros[-1]:.1f}%, "
        f"saved activations {stats.ratio:.2f}x smaller"
    )
    if args.plot and rank == 0:
        plot(args.plot, losses, zeros)
        say(f"plot written to {args.plot}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
