"""Host cost of the operations a stored tensor needs, on CUDA: aten views and copies, events,
Triton launches (through JITFunction, the compiled kernel's launcher and the codec's direct
launch) and the codec API on one-tile tensors (so that the GPU keeps up); and whether a Triton
kernel can write a pinned host tensor (zero-copy)."""

import time

import torch
import triton
import triton.language as tl

from bitsparse import ValueBuffer, compress, decompress
from bitsparse.codecs import get_codec, triton_codec
from bitsparse.compressed import compress_into, decompress_with
from bitsparse.format import TileGeometry, dtype_spec


@triton.jit
def _write_kernel(out_ptr, value):
    tl.store(out_ptr, value)


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * elapsed / n


def main():
    x = torch.rand(12000 * 3072, device="cuda", dtype=torch.bfloat16)
    spec = dtype_spec(torch.bfloat16)
    geometry = TileGeometry()
    cursor = torch.zeros(1, dtype=torch.int64, device="cuda")
    pinned = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    buffer = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    small = x[:4096]
    codec = get_codec("triton", x.device)
    values = ValueBuffer(1 << 24, "cuda")
    fixed = torch.empty(geometry.fixed_nbytes(small.numel()) // 4, dtype=torch.int32, device="cuda")
    small_c = compress(small)
    small_out = torch.empty_like(small)
    event = torch.cuda.Event()
    event.record()
    costs = {
        "x.view(-1)": lambda: x.view(-1),
        "buffer[a:b]": lambda: buffer[100:200],
        "x.detach()": lambda: x.detach(),
        "x.permute(0)": lambda: x.permute(0),
        "cursor.clone()": lambda: cursor.clone(),
        "torch.empty(1)": lambda: torch.empty(1, device="cuda"),
        "pinned[1:2].copy_(cursor)": lambda: pinned[1:2].copy_(cursor, non_blocking=True),
        "Event() + record()": lambda: torch.cuda.Event().record(),
        "event.query()": event.query,
        "triton: 2-arg kernel": lambda: _write_kernel[(1,)](cursor, 3),
        "triton_codec.decode, 1 tile": lambda: triton_codec.decode(
            small_c.fixed, small_c.values.words, small_c.base, small_out, spec, geometry, False
        ),
        "decompress, 1 tile": lambda: decompress(small_c),
        "compress_into, 1 tile": lambda: compress_into(small, codec, geometry, values, fixed, False),
        "decompress_with, 1 tile": lambda: decompress_with(small_c, codec),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "_cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
        "compress, 1 tile": lambda: compress(small),
    }
    compiled = _write_kernel[(1,)](cursor, 3)
    stream = torch.cuda.current_stream().cuda_stream
    costs["compiled 2-arg kernel .run"] = lambda: compiled.run(
        1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, cursor, 3
    )
    direct = triton_codec._direct_launch(compiled)  # the codec's direct launch: the static launcher
    address = cursor.data_ptr()
    costs["direct launch, 2-arg kernel"] = lambda: direct(1, stream, (address, 3))
    costs["x.record_stream(stream)"] = lambda: x.record_stream(torch.cuda.current_stream())
    print(f"{'operation':<32}{'us/call':>9}")
    for name, fn in costs.items():
        n = 2000
        print(f"{name:<32}{per_call_us(fn, n):>9.1f}")
    try:
        _write_kernel[(1,)](pinned[3:], 1234567)
        torch.cuda.synchronize()
        print("zero-copy write to pinned memory:", "works" if int(pinned[3]) == 1234567 else f"wrong {pinned}")
    except Exception as e:  # noqa: BLE001
        print("zero-copy write to pinned memory failed:", type(e).__name__, e)


if __name__ == "__main__":
    main()
