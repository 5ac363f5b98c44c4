"""Where does a BitSparse GPT step spend host time? cProfile of steps at T=12000 on CUDA.

The step of docs/benchmarks.md is host-bound in its forward, so host time BitSparse adds
there lengthens the step one for one; this prints where that time goes.
"""

import cProfile
import os
import pstats
import statistics
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import bitsparse  # noqa: E402
from bitsparse.bench.models import GPT, GPTConfig, shift_to_sparsity  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    config = GPTConfig()
    model = GPT(config).cuda().to(torch.bfloat16)
    tokens = torch.randint(config.vocab, (1, 12000), device="cuda")

    def loss_fn():
        return model(tokens, tokens)

    shift_to_sparsity(model, loss_fn, 0.9)

    def step(compressed: bool) -> None:
        if compressed:
            with bitsparse.compressing():
                loss = loss_fn()
        else:
            loss = loss_fn()
        loss.backward()

    for _ in range(4):
        step(False)
        step(True)
    for compressed in (False, True):
        forward, whole = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(compressed)
            whole.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with bitsparse.compressing() if compressed else torch.enable_grad():
                loss = loss_fn()
            forward.append(time.perf_counter() - t0)
            loss.backward()
        print(
            f"{'bitsparse' if compressed else 'dense':<10} host ms: forward enqueue "
            f"{1000 * statistics.median(forward):.1f}, step until backward returns "
            f"{1000 * statistics.median(whole):.1f}"
        )
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        step(True)
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    # The host time BitSparse adds, by function (its own code and Triton's launcher).
    stats.sort_stats("cumulative").print_stats("bitsparse|allocator|hooks|triton/runtime", 30)


if __name__ == "__main__":
    main()
