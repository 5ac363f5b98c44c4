"""BitSparse quick start: compress a ReLU activation and restore it bit for bit, then train a
small ReLU^2 MLP with ``bitsparse.compressing()`` and check that its gradients are unchanged.

Run from the repository root after ``pip install -e .``::

    python examples/quickstart.py

Uses the GPU when one is available (Triton codec), else the CPU (PyTorch codec). Takes a few
seconds on a CPU.
"""

import time

import torch

import bitsparse
from bitsparse.format import break_even_zero_fraction


def make_activation(device: torch.device) -> torch.Tensor:
    """A ReLU output like an MLP's hidden layer: 4096 tokens x 3072 features, bfloat16.

    The pre-activation is shifted down by the standard normal's 90th percentile (1.2816),
    as a trained network's bias would, so that about 90% of the outputs are exact zeros.
    """
    generator = torch.Generator(device=device).manual_seed(0)
    pre_activation = torch.randn(4096, 3072, device=device, generator=generator) - 1.2816
    return torch.relu(pre_activation).to(torch.bfloat16)


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = make_activation(device)

    # Compress with the default backend for the device. ReLU outputs are never negative, so
    # sign packing stores each bf16 value in 15 bits (tiles holding a value with its sign bit
    # set, such as -0.0, would be stored raw, so the result is exact for any input).
    start = time.perf_counter()
    c = bitsparse.compress(x, sign_pack=True)
    y = bitsparse.decompress(c)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    # Lossless: the restored tensor has the same shape and dtype and is equal bit for bit.
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y.view(torch.int16), x.view(torch.int16)), "round trip is not bit-exact"

    # nbytes reads the stream length from the device, so it synchronizes: fine here, but
    # keep it out of a training step.
    dense, compressed = c.dense_nbytes, c.nbytes
    zero_fraction = 1 - c.nnz() / c.numel
    print(f"device:             {device} (compress + decompress took {elapsed:.2f} s)")
    print(f"tensor:             {tuple(x.shape)} {x.dtype}")
    print(f"zero fraction:      {zero_fraction:.2%}")
    print(f"dense bytes:        {dense:,}")
    print(f"compressed bytes:   {compressed:,}")
    print(f"ratio:              {dense / compressed:.2f}x smaller")
    print(
        "break-even zeros:   "
        f"{break_even_zero_fraction(c.spec, sign_pack=False):.2%} raw, "
        f"{break_even_zero_fraction(c.spec, sign_pack=True):.2%} sign-packed "
        "(a tile with fewer zeros is larger compressed than dense)"
    )
    print("round trip:         bit-exact")
    train_step(device)


def train_step(device: torch.device) -> None:
    """One forward and backward of a ReLU^2 MLP, plain and under ``compressing()``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)
    ).to(device)
    batch = torch.randn(1024, 512, device=device)

    def gradients(use_bitsparse: bool) -> list[torch.Tensor]:
        model.zero_grad()
        if use_bitsparse:
            with bitsparse.compressing():  # the ReLU output autograd saves is compressed
                loss = model(batch).square().mean()
        else:
            loss = model(batch).square().mean()
        loss.backward()  # ... and restored here
        return [p.grad.clone() for p in model.parameters()]

    plain = gradients(False)
    # The first step measures what it would store (and keeps it dense); the arena then has
    # room for it, and the second step stores it compressed.
    for step in ("first", "second"):
        compressed = gradients(True)
        assert all(torch.equal(a, b) for a, b in zip(plain, compressed)), "gradients differ"
        print(f"{step + ' step:':<20}{bitsparse.stats()}")
    print("gradients:          bit-identical to the plain run")


if __name__ == "__main__":
    main()
