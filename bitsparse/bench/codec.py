"""Codec throughput: encode and decode against a device-to-device copy, on one CUDA device.

Bandwidth counts bytes read plus bytes written, the way the copy is counted: encode reads the
dense tensor and writes masks, tile words and the value stream; decode does the reverse.
Every case is checked for an exact round trip before it is timed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch

from bitsparse.bench.training import write_csv
from bitsparse.codecs import get_codec
from bitsparse.compressed import ValueBuffer
from bitsparse.format import TileGeometry, dtype_spec

CASES = [
    # (dtype, zero fraction, sign_pack)
    (torch.bfloat16, 0.5, False),
    (torch.bfloat16, 0.9, False),
    (torch.bfloat16, 0.5, True),
    (torch.bfloat16, 0.9, True),
    (torch.float8_e4m3fn, 0.5, False),
    (torch.float8_e4m3fn, 0.9, False),
    (torch.float8_e4m3fn, 0.9, True),
    (torch.float32, 0.9, False),
]


def relu_like(numel: int, zero_fraction: float, dtype: torch.dtype, device) -> torch.Tensor:
    """ReLU of shifted Gaussians: ``zero_fraction`` of the elements are exactly zero."""
    shift = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(zero_fraction)).item()
    x = torch.randn(numel, device=device, dtype=torch.float32).sub_(shift).relu_()
    return x.to(dtype)


def time_ms(fn, device, before=None, reps: int = 30, warmup: int = 5) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs of work on ``device``: CUDA events on a
    GPU, else a host clock.

    On a GPU the runs are queued back to back and timed by events around each, so a run's
    time is the device's: the host launches the next run while the GPU still works on the
    one before. (Synchronizing after each run instead left the GPU idle at every start
    event while the host launched ``fn``, and counted that launch in the run's time.)
    ``before`` runs ahead of each timed call, outside the timed window.
    """
    for _ in range(warmup):
        if before:
            before()
        fn()
    if torch.device(device).type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            if before:
                before()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)
    times = []
    for _ in range(reps):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure(x: torch.Tensor, sign_pack: bool, backend: str, reps: int) -> dict:
    spec = dtype_spec(x.dtype)
    geometry = TileGeometry()
    codec = get_codec(backend, x.device)
    fixed = torch.empty(geometry.fixed_nbytes(x.numel()) // 4, dtype=torch.int32, device=x.device)
    values = ValueBuffer(geometry.max_stream_words(x.numel(), spec.bits), x.device)
    base = torch.empty(1, dtype=torch.int64, device=x.device)  # written by encode
    out = torch.empty_like(x)

    def encode():
        codec.encode(x, fixed, values.words, values.cursor, values.appends, base, spec, geometry, sign_pack)

    def decode():
        codec.decode(fixed, values.words, base, out, spec, geometry, sign_pack)

    values.reset()
    encode()
    decode()
    if not torch.equal(out.view(spec.bits_dtype), x.view(spec.bits_dtype)):
        raise AssertionError(f"round trip failed for {x.dtype}, sign_pack={sign_pack}")
    stream_bytes = 4 * int(values.cursor)
    fixed_bytes = fixed.numel() * 4
    moved = x.numel() * spec.itemsize + fixed_bytes + stream_bytes
    encode_ms = time_ms(encode, x.device, before=values.reset, reps=reps)
    decode_ms = time_ms(decode, x.device, reps=reps)
    return {
        "stored_bytes": fixed_bytes + stream_bytes,
        "encode_ms": encode_ms,
        "decode_ms": decode_ms,
        "encode_gbs": moved / encode_ms / 1e6,
        "decode_gbs": moved / decode_ms / 1e6,
    }


def kernels_in_use(backend: str, device) -> str:
    """Which Triton kernels serve the cases, for the header (see ``triton_codec``)."""
    if backend != "triton" or device != "cuda":
        return ""
    from bitsparse.codecs import triton_codec

    if triton_codec._GLUON:
        return " (Gluon encoder; Gluon decoder for 8- and 16-bit values and where tiles may be packed)"
    return " (portable kernels)"


def copy_gbs(numel: int, reps: int, device) -> float:
    src = torch.empty(numel * 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=reps)
    return 2 * src.numel() / ms / 1e6


def one_way_gbs(numel: int, reps: int, device) -> tuple[float, float]:
    """Bandwidth of writing only (a fill) and of reading only (a max reduction) as many bytes
    as the copy moves: bounds for decoding, which mostly writes, and encoding, which mostly
    reads, when the memory serves one direction slower than the mix of a copy."""
    words = torch.empty(numel, dtype=torch.int32, device=device).random_()
    # Filled as 32-bit words: PyTorch's fill of 1- and 2-byte elements measured 25% slower on
    # the H200 than its fill of words, which is the one that writes at the memory's pace.
    fill_ms = time_ms(lambda: words.fill_(0x01010101), device, reps=reps)
    read_ms = time_ms(lambda: torch.amax(words), device, reps=reps)
    nbytes = 4 * numel
    return nbytes / fill_ms / 1e6, nbytes / read_ms / 1e6


def run(args: argparse.Namespace) -> list[dict]:
    if args.quick:  # a small CPU version, for the test suite
        device, numel, reps, backend = "cpu", 1 << 16, 3, "torch"
    elif torch.cuda.is_available():
        device, numel, reps, backend = "cuda", 1 << args.log2_numel, args.reps, args.backend
    else:
        raise SystemExit("the codec benchmark needs a CUDA device (or --quick for a CPU run)")
    torch.manual_seed(0)
    copy = copy_gbs(numel, reps, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    write_only, read_only = one_way_gbs(numel, reps, device)
    print(
        f"{name}: device-to-device copy {copy:.0f} GB/s (bytes read + written), "
        f"{numel} elements per case, {backend} backend{kernels_in_use(backend, device)}"
    )
    print(
        f"one way: writing only {write_only:.0f} GB/s ({100 * write_only / copy:.1f}% of copy), "
        f"reading only {read_only:.0f} GB/s ({100 * read_only / copy:.1f}%)"
    )
    print(
        f"{'dtype':<14}{'zeros':>6}{'packed':>7}{'ratio':>7}{'encode GB/s':>13}{'%copy':>7}"
        f"{'decode GB/s':>13}{'%copy':>7}"
    )
    rows = []
    for dtype, zeros, sign_pack in CASES:
        x = relu_like(numel, zeros, dtype, device)
        result = measure(x, sign_pack, backend, reps)
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "zeros": zeros,
            "sign_pack": sign_pack,
            "ratio": x.numel() * x.element_size() / result["stored_bytes"],
            **result,
            "encode_pct_copy": 100 * result["encode_gbs"] / copy,
            "decode_pct_copy": 100 * result["decode_gbs"] / copy,
            "copy_gbs": copy,
            "write_only_gbs": write_only,
            "read_only_gbs": read_only,
        }
        rows.append(row)
        print(
            f"{row['dtype']:<14}{zeros:>6.2f}{str(sign_pack):>7}{row['ratio']:>7.2f}"
            f"{row['encode_gbs']:>13.0f}{row['encode_pct_copy']:>6.1f}%"
            f"{row['decode_gbs']:>13.0f}{row['decode_pct_copy']:>6.1f}%"
        )
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "codec.csv"), rows)
    plot(os.path.join(args.out, "codec.png"), rows, f"{name}, {numel} elements, {backend} backend")
    return rows


def plot(path: str, rows: list[dict], title: str) -> None:
    """Encode and decode bandwidth per case, as a percentage of the copy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['dtype']}\n{round(100 * r['zeros'])}%{' 15b' if r['sign_pack'] else ''}" for r in rows]
    positions = range(len(rows))
    figure, axis = plt.subplots(figsize=(10, 4))
    axis.bar([p - 0.2 for p in positions], [r["encode_pct_copy"] for r in rows], 0.4, label="encode")
    axis.bar([p + 0.2 for p in positions], [r["decode_pct_copy"] for r in rows], 0.4, label="decode")
    axis.set_xticks(list(positions), labels, fontsize=7)
    axis.set_ylabel("% of device-to-device copy bandwidth")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def sweep(args: argparse.Namespace) -> None:
    """Try launch options of the kernels that serve bf16 on CUDA, and print each configuration."""
    from bitsparse.codecs import gluon_kernels, triton_codec

    # (the per-width launchers the configuration replaces for bf16, kernel, options)
    configurations = [
        (triton_codec._gluon_encode_launchers, gluon_kernels.encode_kernel, {"num_warps": w, "maxnreg": r})
        for w, r in itertools.product((4, 8), (None, 56, 64, 72, 80))
    ]
    configurations += [
        (triton_codec._gluon_decode_launchers, gluon_kernels.decode_kernel, {"num_warps": w, "maxnreg": r})
        for w, r in itertools.product((4, 8), (None, 32, 48))
    ]

    def install(launchers, launcher):
        shipped, launchers[16] = launchers[16], launcher
        return shipped

    torch.manual_seed(0)
    numel = 1 << args.log2_numel
    copy = copy_gbs(numel, args.reps, "cuda")
    for zeros, sign_pack in ((0.5, False), (0.9, False), (0.9, True)):
        x = relu_like(numel, zeros, torch.bfloat16, "cuda")
        for place, kernel, options in configurations:
            options = {key: value for key, value in options.items() if value is not None}
            shipped = install(place, triton_codec._Launcher(kernel, **options))  # a fresh compile cache
            try:
                r = measure(x, sign_pack, "triton", args.reps)
            finally:
                install(place, shipped)
            print(
                f"zeros={zeros} sign_pack={sign_pack!s:<5} {kernel.__name__} {options}  "
                f"encode {100 * r['encode_gbs'] / copy:5.1f}%  decode {100 * r['decode_gbs'] / copy:5.1f}%"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log2-numel", type=int, default=28, help="elements per case, as a power of two")
    parser.add_argument("--reps", type=int, default=30, help="timed runs per measurement (median)")
    parser.add_argument("--backend", default="triton", choices=("triton", "torch"))
    parser.add_argument("--sweep", action="store_true", help="sweep Triton launch parameters instead")
    parser.add_argument("--quick", action="store_true", help="a small CPU run of the torch codec")
    parser.add_argument("--out", default=".", help="folder for the CSV and PNG")
