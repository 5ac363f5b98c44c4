"""The host time of BitSparse's own Python per saved tensor, without the GPU or its noise.

``python scripts/host_path.py`` runs the chains of ``python -m bitsparse.bench hooks`` (each
op saving its output: ``relu`` outputs are stored, ``tanh`` outputs skipped), and chains of
``addcmul(h, h, weight)``, which saves its input and a parameter, and of the same op on views
of both (as a ``Linear`` saves ``weight.t()``), all skipped, on the CPU, with
the session's arenas reporting through slots as on CUDA and with a codec that launches no
kernel: it moves the value cursor by a tenth of each tensor's words and writes the report
word, as an encoder's last program does. What it measures is everything a saved tensor costs
the host apart from the kernel launches (the session, the arena, the handles, the accounting),
as interleaved medians against plain autograd. On the H200's hosts the same path costs about
as much again for the encoder's launch, and varies by a third from machine to machine; this
measure varies by about a microsecond from run to run on one machine, so compare code with it
(``PYTHONPATH`` pointing at another installed copy runs that one).

In a model the same path runs between the model's own work, which evicts what it touched
from the CPU's caches: ``--cold`` evicts them before every op (in both modes, see
``CacheEvictor``), which about doubles the stored chain's figure, as a model does.

``--compiled`` adds two compiled chains of 12 residual blocks ``x + proj(relu(fc(x)))``
(``ResidualReLU``), compiled whole and block by block, whose compiled forwards store the ReLU
outputs they save and whose backwards restore them, against the same compiled chains without
BitSparse. Beside each, the same chain under BitSparse's hooks with nothing to store (every
tensor below ``min_numel``): what PyTorch's handling of compiled code under saved-tensor
hooks costs (guards on the hooks, the hooks disabled around each compiled region), which
BitSparse's stores come on top of.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import pstats
import statistics
import time

import torch

import bitsparse
from bitsparse.allocator import Arena, pool
from bitsparse.bench.hooks import chain_step
from bitsparse.hooks import manager


class LaunchlessCodec:
    """A codec that keeps the append protocol (cursor, report word) and writes nothing else."""

    name = "launchless"

    def check_device(self, device: torch.device) -> None:
        pass

    def encoder(self, stream, cursor, appends, spec, geometry, sign_pack, numel, count_nonzeros, report, square=False):
        cursor_word, words = cursor.numpy(), numel // 10

        def encode_into(x, fixed, base, nonzeros=None, report_word=None, square=None):
            cursor_word[0] += words
            if report_word is not None:
                report_word.numpy()[0] = cursor_word[0] + 1

        return encode_into

    def decoder(self, stream, spec, geometry, sign_pack, numel):
        return lambda fixed, base, out, square=None, square_grad=None: None

    def measure(self, x, cursor, appends, spec, geometry, sign_pack, report=None, relu_square=None):
        cursor += x.numel() // 10
        if report is not None:
            report.copy_(cursor + 1)

    def measure_tiles(self, x, tile_words, spec, geometry, sign_pack, relu_square=None):
        tile_words.fill_(geometry.tile_size // 10)


class CacheEvictor:
    """Evicts from the CPU's caches what the hooks touched, as a model's own work between two
    saved tensors does: reads about 2000 Python objects scattered over a large list and writes
    one cache line in every 4 KiB page of a 16 MiB buffer."""

    def __init__(self):
        self._objects = [{"value": i} for i in range(200_000)]
        self._buffer = bytearray(16 << 20)
        self._zeros = bytes(len(self._buffer) // 4096)

    def touch(self) -> None:
        total = 0  # only read: each object's memory is what is brought into the caches
        for item in self._objects[::97]:
            total += item["value"]
        self._buffer[::4096] = self._zeros


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200, help="saved tensors per step")
    parser.add_argument("--numel", type=int, default=1 << 13, help="elements per saved tensor")
    parser.add_argument("--repeats", type=int, default=80, help="interleaved rounds")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the stored chain")
    parser.add_argument("--cold", action="store_true", help="evict the CPU's caches before every op")
    parser.add_argument("--compiled", action="store_true", help="add the compiled chains (whole and per block)")
    args = parser.parse_args()
    codec = LaunchlessCodec()
    manager.get_codec = lambda backend, device: codec
    pool.Arena = functools.partial(Arena, asynchronous=True)
    x = torch.relu(torch.randn(args.numel) - 1.28).requires_grad_()
    weight = torch.nn.Parameter(torch.ones(args.numel))
    contexts = {"plain": contextlib.nullcontext, "bitsparse": lambda: bitsparse.compressing(min_numel=args.numel)}
    print(f"{args.tensors} saved tensors of {args.numel} float32 elements per step, medians of {args.repeats} rounds")
    print(f"  {'chain':<10}{'fwd host':>10}{'bwd host':>10}   us per saved tensor added to plain autograd's")
    chains = {
        "stored": torch.relu,
        "skipped": torch.tanh,
        "parameter": lambda h: torch.addcmul(h, h, weight),
        "views": lambda h: torch.addcmul(h, h.view(-1), weight.view(-1)),
    }
    if args.cold:
        evictor = CacheEvictor()
        chains = {chain: functools.partial(_after, evictor.touch, op) for chain, op in chains.items()}
    for chain, op in chains.items():
        for _ in range(5):
            for context in contexts.values():
                chain_step(op, x, args.tensors, context())
        samples = {mode: [] for mode in contexts}
        for _ in range(args.repeats):
            for mode, context in contexts.items():
                samples[mode].append(chain_step(op, x, args.tensors, context()))
        medians = {mode: [statistics.median(s[i] for s in v) for i in range(2)] for mode, v in samples.items()}
        added = [1e6 * (medians["bitsparse"][i] - medians["plain"][i]) / args.tensors for i in range(2)]
        print(f"  {chain:<10}{added[0]:>10.1f}{added[1]:>10.1f}")
        if args.profile and chain == "stored":
            profile = cProfile.Profile()
            profile.runcall(lambda: [chain_step(op, x, args.tensors, contexts["bitsparse"]()) for _ in range(10)])
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    print(bitsparse.stats())
    if args.compiled:
        for scope in ("model", "block"):
            added, stored = compiled_chain(args.repeats, scope)
            print(
                f"  {'compiled ' + scope:<14}{added['bitsparse'][0]:>6.1f}{added['bitsparse'][1]:>10.1f}"
                f"   per stored tensor ({stored} a step); with nothing to store"
                f" {added['nothing stored'][0]:.1f} and {added['nothing stored'][1]:.1f}"
            )


class ResidualReLU(torch.nn.Module):
    """``x + proj(relu(fc(x)))``, bias-free and 64 wide: the compiled chains' block, whose ReLU
    output a compiled forward saves (and BitSparse stores)."""

    def __init__(self):
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(x)))


def compiled_chain(repeats: int, scope: str, blocks: int = 12, rows: int = 128) -> tuple[dict, int]:
    """The host time BitSparse adds per stored tensor to the forward and the backward of a
    chain of ``blocks`` ``ResidualReLU`` blocks on ``rows`` rows, compiled whole (``scope``
    "model") or block by block ("block"), medians of ``repeats`` interleaved steps against
    the same compiled chain without BitSparse, by mode ("bitsparse", and "nothing stored":
    its hooks with a ``min_numel`` above every tensor's size, per tensor the other mode
    stores); and the tensors a step stores."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[ResidualReLU() for _ in range(blocks)])
    if scope == "model":
        model = torch.compile(model)
    else:
        for block in model:
            block.compile()
    x = torch.randn(rows, 64, requires_grad=True)
    contexts = {
        "plain": contextlib.nullcontext,
        "bitsparse": lambda: bitsparse.compressing(min_numel=rows * 64),
        "nothing stored": lambda: bitsparse.compressing(min_numel=rows * 64 + 1),
    }

    def step(context) -> tuple[float, float]:
        start = time.perf_counter()
        with context():
            y = model(x)
        forward = time.perf_counter() - start
        y.sum().backward()
        return forward, time.perf_counter() - start - forward

    for _ in range(5):
        for context in contexts.values():
            step(context)
    step(contexts["bitsparse"])  # the statistics are the last step's: one that stores
    stored = bitsparse.stats().tensors_compressed
    samples = {mode: [] for mode in contexts}
    for _ in range(repeats):
        for mode, context in contexts.items():
            samples[mode].append(step(context))
    medians = {mode: [statistics.median(s[i] for s in v) for i in range(2)] for mode, v in samples.items()}
    added = {
        mode: [1e6 * (m[i] - medians["plain"][i]) / stored for i in range(2)]
        for mode, m in medians.items()
        if mode != "plain"
    }
    return added, stored


def _after(first, op, h: torch.Tensor) -> torch.Tensor:
    first()
    return op(h)


if __name__ == "__main__":
    main()
