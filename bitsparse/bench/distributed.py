"""The ``distributed`` suite: the ``gpt`` suite's 12-layer GPT sharded with FSDP2 over the
processes torchrun starts, ``T`` tokens per process, dense, with MLP checkpointing and with
BitSparse.

    torchrun --nproc-per-node 2 -m bitsparse.bench distributed            # NCCL, a GPU per process
    torchrun --nproc-per-node 2 -m bitsparse.bench distributed --quick    # a tiny GPT, gloo on the CPU

Every process shards each block and then the root with ``fully_shard`` and runs
``training.compare_modes`` on tokens of its own, so the figures are per GPU: a step's peak
allocated memory above what was allocated before its forward (the gathered parameters and
gradient buffers of FSDP2 included, the BitSparse arena counted at its full capacity), and the
median step time over interleaved repeats. One step's gradients are compared with dense's bit
for bit under deterministic kernels; ``torch.equal`` on the sharded gradients compares every
process's shard, so "equal" holds on every GPU. Process 0 prints a table per process and writes
``distributed.csv``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os

import torch
import torch.distributed as dist

from bitsparse.bench import training
from bitsparse.bench.models import GPT, GPTConfig, shift_to_sparsity

DEFAULT_MODES = ("dense", "checkpoint", "bitsparse")
DEFAULT_TOKENS = 12000


def init_from_torchrun(device_type: str) -> torch.device:
    """Join the process group torchrun describes in the environment: NCCL for ``device_type``
    "cuda", where each process takes the GPU of its ``LOCAL_RANK``, gloo otherwise (the CPU).
    Returns this process's device.

    Raises:
        SystemExit: the process was not started by torchrun (``LOCAL_RANK`` is not set).
    """
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("LOCAL_RANK is not set: start this with torchrun --nproc-per-node N (one process per GPU)")
    if device_type != "cuda":
        dist.init_process_group("gloo")
        return torch.device(device_type)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


@contextlib.contextmanager
def leaving_process_group():
    """Destroy the default process group when the block ends: after a garbage collection and a
    barrier when it ends normally, at once when it raises (the other processes may never reach
    a barrier).

    Both guard against gloo aborting a process at its exit ("terminate called without an active
    exception"). The barrier: a process that exits while another still works in the group
    (process 0 printing the tables, say) closes connections under that one's gloo threads. The
    collection: a collective issued during backward keeps, in the thread-local state it
    captured, the context object autograd stashes there (torch 2.13, 2.14); where only the
    interpreter's last garbage collection frees it, at exit, its release on a gloo thread asks
    for the GIL while the interpreter finalizes, which aborts the process (seen in about one
    run in ten of the quick bench on a 2-core CPU; none in 60 with the collection). Collected
    here, it goes while the interpreter is alive.
    """
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def sharded_gpt(config: GPTConfig, tokens: int, zeros: float | None, device: torch.device):
    """``(model, loss_fn)``: a bfloat16 GPT sharded with FSDP2 (each block, then the root), with
    ``zeros`` of its MLP pre-activations shifted to zero (None: as initialised), and a loss on
    ``tokens`` random tokens of this process's own."""
    # Imported here: examples/train_gpt.py imports this module for init_from_torchrun alone.
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same weights in every process, as fully_shard expects
    model = GPT(config).to(device=device, dtype=torch.bfloat16)
    if zeros is not None:
        # Before sharding, on tokens every process draws alike: every process shifts the same biases alike.
        calibration = torch.randint(config.vocab, (1, tokens), device=device)
        shift_to_sparsity(model, lambda: model(calibration, calibration), zeros)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    generator = torch.Generator(device).manual_seed(1 + dist.get_rank())
    inputs, targets = torch.randint(config.vocab, (2, 1, tokens), device=device, generator=generator)
    return model, lambda: model(inputs, targets)


def run(args: argparse.Namespace) -> list[dict]:
    """Compare the modes at every zero level in every process; process 0 prints each process's
    table and writes ``distributed.csv``. Every process returns the rows of all.

    Raises:
        SystemExit: not started by torchrun.
    """
    device = init_from_torchrun("cuda" if torch.cuda.is_available() else "cpu")
    with leaving_process_group():
        return _compare(args, device)


def _compare(args: argparse.Namespace, device: torch.device) -> list[dict]:
    rank, processes = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(layers=2, dim=64, heads=2, head_dim=32, hidden=256, vocab=512) if args.quick else GPTConfig()
    tokens = args.tokens or (64 if args.quick else DEFAULT_TOKENS)
    options = training.bitsparse_options(args)
    rows = []
    for zeros in args.zeros:
        model, loss_fn = sharded_gpt(config, tokens, zeros, device)
        static = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        results = training.compare_modes(
            model, loss_fn, tokens, args.modes, args.repeats, args.warmup, options, args.compile_scope
        )
        every_process = [None] * processes
        dist.all_gather_object(every_process, (results, static))
        label = "init" if zeros is None else f"{round(100 * zeros)}%"
        for process, (process_results, process_static) in enumerate(every_process):
            process_rows = training.as_rows(
                process_results, suite="distributed", rank=process, processes=processes, T=tokens, zeros=label
            )
            if args.budget_gib:
                training.largest_fitting(process_rows, "T", args.budget_gib * 2**30, process_static)
            rows += process_rows
            if rank == 0:
                training.print_table(
                    f"distributed ({dist.get_backend()}, FSDP2, {processes} processes) T={tokens} per process, "
                    f"MLP zeros {label}: rank {process}",
                    process_results,
                )
        del model, loss_fn
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank != 0:
        return rows
    os.makedirs(args.out, exist_ok=True)
    training.write_csv(os.path.join(args.out, "distributed.csv"), rows)
    if args.budget_gib:
        print(f"largest T per process within {args.budget_gib} GiB (linear extrapolation per mode and process):")
        for row in rows:
            print(f"  {row['zeros']:>5} zeros  process {row['rank']}  {row['mode']:<16} {row['fits_budget']}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, help=f"tokens per process (default {DEFAULT_TOKENS}; 64 with --quick)")
    training.add_common_arguments(parser, zeros_default=[None, 0.9])
    parser.set_defaults(modes=list(DEFAULT_MODES))
