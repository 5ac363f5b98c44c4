"""BitSparse in several processes: DDP and FSDP2 with two ranks, and the torchrun entry points.

Two spawned processes train the pre-norm ReLU^2 transformer of ``test_hooks`` for three optimizer
steps on data of their own, wrapped in DDP or sharded with FSDP2 (``fully_shard`` per block, then
the root), without BitSparse, under ``compressing()`` and under ``enable()``, on the CPU over
gloo and, where two GPUs are (``-m gpu``), each on its own GPU over NCCL; the parent checks
that gradients and weights are bit-identical on every rank, that each rank's ``stats()`` counts
its own forward's tensors only, and that no compressed tensor outlives backward. One spawn runs
every case (a spawn costs seconds of imports); a failing rank fails the tests with its traceback.

The last tests run ``examples/train_gpt.py --ddp`` and ``python -m bitsparse.bench distributed``
under torchrun, two CPU processes each.
"""

from __future__ import annotations

import contextlib
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_hooks import OPTIONS, loss_of, sequence_input, transformer
from torch.distributed.tensor import DTensor

import bitsparse
from bitsparse.bench.distributed import DEFAULT_MODES, leaving_process_group
from bitsparse.bench.training import deterministic_kernels

fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
STEPS = 3
WRAPPERS = ("ddp", "fsdp2")
HOOKS = ("compressing", "enable")
CASES = [(wrapper, hooks) for wrapper in WRAPPERS for hooks in HOOKS]
BACKENDS = [
    "gloo",
    pytest.param(
        "nccl",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE, reason=f"needs {WORLD_SIZE} CUDA devices"),
        ],
    ),
]
"""gloo: the ranks on the CPU; NCCL: rank ``r`` on CUDA device ``r``."""
SPAWN_TIMEOUT_S = 120
"""Bounds a hung collective: the ranks are killed and the tests fail."""
TORCHRUN_TIMEOUT_S = 180
RELU_OUTPUTS = 3
"""The transformer's three blocks each store one ReLU output (its square is recomputed)."""
RELU_OUTPUT_BYTES = 4 * 16 * 128 * 4
"""One block's ReLU output for ``sequence_input()``: batch 4, 16 tokens, hidden 128, float32."""

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


# --------------------------------------------------------------------------------------------
# What each rank runs (at module level, so that spawned processes can import it)


def wrap(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    """``model`` in DDP, or sharded with FSDP2: each block, then the root."""
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    for block in list(model)[:-1]:
        fully_shard(block)
    return fully_shard(model)


def local(t: torch.Tensor) -> torch.Tensor:
    """A copy in host memory of this rank's part of ``t`` (its shard, for an FSDP2 parameter
    or gradient)."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def train(wrapper: str, hooks: str | None, rank: int, device: torch.device) -> dict:
    """Train ``STEPS`` steps of the wrapped transformer on ``device`` on this rank's data, with
    ``hooks`` ("compressing", "enable" or None for none); what each step produced, and
    BitSparse's statistics and live tensors after each backward and at the end."""
    model = wrap(transformer().to(device), wrapper)  # the same initial weights on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = {"grads": [], "stats": []}
    if hooks == "enable":
        bitsparse.enable(**OPTIONS)
    try:
        for step in range(STEPS):
            # Every rank and step its own data.
            x = sequence_input(seed=1 + WORLD_SIZE * step + rank).detach().to(device).requires_grad_()
            optimizer.zero_grad(set_to_none=True)
            with bitsparse.compressing(**OPTIONS) if hooks == "compressing" else contextlib.nullcontext():
                out = model(x)
            loss_of(out).backward()
            run["grads"].append([local(p.grad) for p in model.parameters()] + [local(x.grad)])
            run["stats"].append(bitsparse.stats().as_dict())
            optimizer.step()
    finally:
        bitsparse.disable()
    run["weights"] = [local(p) for p in model.parameters()]
    del model, optimizer, out, x
    run["alive_at_end"] = bitsparse.stats().tensors_alive
    bitsparse.reset()
    return run


def run_rank(rank: int, backend: str, store_path: str, out_dir: str) -> None:
    """One rank of the spawned group on ``backend`` (see ``BACKENDS``): every case, saved to
    ``out_dir/rank<rank>.pt``."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=WORLD_SIZE, device_id=device if backend == "nccl" else None
    )
    with leaving_process_group(), deterministic_kernels():
        runs = {}
        for wrapper in WRAPPERS:
            runs[wrapper, None] = train(wrapper, None, rank, device)
            for hooks in HOOKS:
                runs[wrapper, hooks] = train(wrapper, hooks, rank, device)
        torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn_ranks(backend: str, tmp: Path) -> list[dict]:
    """Run ``run_rank`` on ``backend`` in ``WORLD_SIZE`` spawned processes; each rank's runs.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank failed (its traceback is in the message).
        pytest.fail.Exception: the ranks ran past ``SPAWN_TIMEOUT_S`` (they are killed).
    """
    context = mp.spawn(run_rank, args=(backend, str(tmp / "store"), str(tmp)), nprocs=WORLD_SIZE, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks ran past {SPAWN_TIMEOUT_S} s (a collective hung?)")
    return [torch.load(tmp / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module", params=BACKENDS)
def ranks(request, tmp_path_factory) -> list[dict]:
    return spawn_ranks(request.param, tmp_path_factory.mktemp(f"ranks-{request.param}"))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def joined(shards_per_rank) -> list[torch.Tensor]:
    """Whole tensors from each rank's list of FSDP2 shards (dim 0, in rank order)."""
    return [torch.cat(shards) for shards in zip(*shards_per_rank)]


# --------------------------------------------------------------------------------------------
# DDP and FSDP2


def test_ranks_train_on_their_own_data_through_the_collectives(ranks):
    ddp = [rank["ddp", None] for rank in ranks]
    fsdp2 = [rank["fsdp2", None] for rank in ranks]
    for step in range(STEPS):
        # Input gradients are not reduced: each rank's are its own data's.
        assert not torch.equal(ddp[0]["grads"][step][-1], ddp[1]["grads"][step][-1])
        # DDP all-reduces the parameters' gradients, the same on every rank; FSDP2
        # reduce-scatters them, and its shards make up DDP's.
        assert same(ddp[0]["grads"][step][:-1], ddp[1]["grads"][step][:-1])
        assert same(joined(run["grads"][step][:-1] for run in fsdp2), ddp[0]["grads"][step][:-1])
    assert same(joined(run["weights"] for run in fsdp2), ddp[0]["weights"])


@pytest.mark.parametrize("wrapper, hooks", CASES)
def test_gradients_and_weights_are_those_without_bitsparse(ranks, wrapper, hooks):
    for rank in ranks:
        plain, compressed = rank[wrapper, None], rank[wrapper, hooks]
        for step in range(STEPS):
            assert same(compressed["grads"][step], plain["grads"][step]), f"step {step + 1}"
        assert same(compressed["weights"], plain["weights"])


@pytest.mark.parametrize("wrapper, hooks", CASES)
def test_each_rank_counts_only_its_own_tensors(ranks, wrapper, hooks):
    per_rank = [rank[wrapper, hooks]["stats"] for rank in ranks]
    for stats in per_rank:
        assert [s["step"] for s in stats] == list(range(1, STEPS + 1))
        for s in stats:
            # One rank's forward: three ReLU outputs stored (the capacity lets step 1 compress).
            assert (s["tensors_compressed"], s["tensors_recomputed"]) == (RELU_OUTPUTS, RELU_OUTPUTS), s
            assert s["dense_bytes"] == RELU_OUTPUTS * RELU_OUTPUT_BYTES
            assert s["fallbacks"] == {}
            assert 0 < s["stored_bytes"] < s["dense_bytes"]
    counts = [[(s["tensors_seen"], s["tensors_compressed"], s["tensors_skipped"]) for s in stats] for stats in per_rank]
    assert counts[0] == counts[1]
    # The zeros each rank counts are those of its own data.
    assert [s["zero_fraction"] for s in per_rank[0]] != [s["zero_fraction"] for s in per_rank[1]]


@pytest.mark.parametrize("wrapper, hooks", CASES)
def test_no_compressed_tensor_outlives_backward(ranks, wrapper, hooks):
    for rank in ranks:
        run = rank[wrapper, hooks]
        assert [s["tensors_alive"] for s in run["stats"]] == [0] * STEPS
        assert run["alive_at_end"] == 0


# --------------------------------------------------------------------------------------------
# torchrun


TEARDOWN_ABORT = "terminate called without an active exception"
"""What a gloo process prints when its teardown aborts it after its work is done: a gloo thread
releasing, while the interpreter exits, a collective that holds a Python object (see
``leaving_process_group``, which makes this rare)."""


def torchrun(backend: str, *args: str, timeout: float = TORCHRUN_TIMEOUT_S) -> str:
    """Run ``torchrun --standalone --nproc-per-node 2 ARGS`` from the repository root on
    ``backend`` (see ``BACKENDS``: gloo hides the GPUs, as the programs take them where they
    are); its stdout.

    A run that gloo's teardown aborted (``TEARDOWN_ABORT`` on stderr) runs once more: the abort is
    torch's, at exit, and a second one in a row fails the test like any other error.

    Raises:
        AssertionError: it exited with a non-zero status (its output is in the message).
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}"]
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if backend == "gloo" else {}))
    for _ in range(2):
        result = subprocess.run(
            [*command, *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        if result.returncode == 0 or TEARDOWN_ABORT not in result.stderr:
            break
    assert result.returncode == 0, f"exit status {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_train_gpt_example_with_ddp(backend):
    out = torchrun(backend, "examples/train_gpt.py", "--ddp", "--config", "tiny", "--steps", "2")
    assert f"on {WORLD_SIZE} processes (DDP, {backend})" in out
    # Printed by rank 0 only, once.
    assert out.count("gradients: identical with and without BitSparse (bit for bit)") == 1
    assert out.count("saved tensors compressed") == 2  # each step's statistics line
    assert out.count("done: loss") == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_distributed_bench_quick(backend, tmp_path):
    out = torchrun(
        backend,
        *("-m", "bitsparse.bench", "distributed", "--quick", "--repeats", "2", "--warmup", "1", "--out", str(tmp_path)),
    )
    with open(tmp_path / "distributed.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["zeros"], r["rank"], r["mode"]) for r in rows) == sorted(
        (zeros, str(rank), mode) for zeros in ("init", "90%") for rank in range(WORLD_SIZE) for mode in DEFAULT_MODES
    )
    # Exact on every rank: torch.equal on the sharded gradients compares every shard.
    assert all(r["grads_equal_dense"] == "True" for r in rows)
    assert all(float(r["step_ms"]) > 0 for r in rows)
    assert min(float(r["compression_ratio"]) for r in rows if r["mode"] == "bitsparse" and r["zeros"] == "90%") > 3
    # Rank 0 prints every rank's table, once per zero level.
    assert [
        out.count(f"MLP zeros {zeros}: rank {rank}\n") for zeros in ("init", "90%") for rank in range(WORLD_SIZE)
    ] == [1] * 4
