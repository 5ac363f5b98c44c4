"""Shared helpers for the BitSparse test suite.

Test modules import these with ``from helpers import ...``: ``tests/conftest.py`` puts the
``tests/`` folder on ``sys.path`` (pytest's default "prepend" import mode would do that too,
since ``tests/`` has no ``__init__.py``; the explicit insertion keeps it working under
``--import-mode=importlib`` as well). Run the suite from the repository root with
``python -m pytest``.

Everything here is independent of the codecs: the reference encoding below is written with
NumPy from the format description in ``bitsparse/format.py``, so comparing a codec against it
checks the codec, not the codec against itself. Only ``format.compressed_nbytes`` is shared,
and ``tests/test_format.py`` pins that function to hand-computed numbers.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from bitsparse import ValueBuffer, decompress
from bitsparse.codecs import get_codec
from bitsparse.compressed import CompressedTensor, compress_into
from bitsparse.format import (
    MAX_TILE_OFFSET,
    SUPPORTED_DTYPES,
    TileGeometry,
    compressed_nbytes,
    dtype_spec,
    tile_stream_words,
)

DTYPES = list(SUPPORTED_DTYPES)

DTYPE_IDS = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
}

_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32}
_NP_SIGNED = {8: np.int8, 16: np.int16, 32: np.int32}


def dtype_id(dtype: torch.dtype) -> str:
    return DTYPE_IDS[dtype]


def seed_of(*parts) -> int:
    """A stable seed derived from test parameters (``hash()`` of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(seed_of(*parts))


# --------------------------------------------------------------------------------------------
# Bit-level views and comparison


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The flattened, contiguous tensor as the signed integer dtype of the same width."""
    return t.detach().reshape(-1).contiguous().view(_SAME_WIDTH_INT[t.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same shape, dtype and device, and the same bit pattern in every element.

    ``-0.0`` and ``0.0`` differ here, and so do NaNs with different payloads or signs.
    """
    assert isinstance(actual, torch.Tensor), type(actual)
    assert isinstance(expected, torch.Tensor), type(expected)
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    assert actual.device == expected.device, f"device {actual.device} != {expected.device}"
    a, e = int_view(actual), int_view(expected)
    if torch.equal(a, e):
        return
    bad = (a != e).nonzero().flatten()
    width = actual.element_size() * 2
    first = [
        (int(i), f"{int(a[i]) & ((1 << 4 * width) - 1):0{width}x}", f"{int(e[i]) & ((1 << 4 * width) - 1):0{width}x}")
        for i in bad[:8].cpu()
    ]
    raise AssertionError(
        f"{bad.numel()} of {a.numel()} elements differ bitwise; first (flat index, actual, expected): {first}"
    )


def to_unsigned_numpy(t: torch.Tensor) -> np.ndarray:
    """Flattened (row-major) bit patterns of a supported float tensor as unsigned NumPy ints."""
    spec = dtype_spec(t.dtype)
    signed = t.detach().reshape(-1).contiguous().view(spec.bits_dtype).cpu().numpy()
    return signed.view(_NP_UNSIGNED[spec.bits])


def from_patterns(patterns, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` from unsigned bit patterns (Python ints or a NumPy array)."""
    spec = dtype_spec(dtype)
    array = np.asarray(patterns, dtype=np.uint64).astype(_NP_UNSIGNED[spec.bits])
    return torch.from_numpy(array.view(_NP_SIGNED[spec.bits])).view(dtype)


# --------------------------------------------------------------------------------------------
# Special values, as unsigned bit patterns. "neg" ones have the sign bit set.

SPECIALS: dict[torch.dtype, dict[str, int]] = {
    torch.bfloat16: {
        "+nan": 0x7FC0,
        "+nan_payload": 0x7F81,  # signalling NaN with a payload
        "+inf": 0x7F80,
        "+min_subnormal": 0x0001,
        "+max_subnormal": 0x007F,
        "+min_normal": 0x0080,
        "+max_finite": 0x7F7F,
        "-zero": 0x8000,
        "-nan": 0xFFC0,
        "-inf": 0xFF80,
        "-min_subnormal": 0x8001,
        "-normal": 0xBFC0,  # -1.5
        "-max_finite": 0xFF7F,
    },
    torch.float16: {
        "+nan": 0x7E00,
        "+nan_payload": 0x7C01,
        "+inf": 0x7C00,
        "+min_subnormal": 0x0001,
        "+max_subnormal": 0x03FF,
        "+min_normal": 0x0400,
        "+max_finite": 0x7BFF,
        "-zero": 0x8000,
        "-nan": 0xFE00,
        "-inf": 0xFC00,
        "-min_subnormal": 0x8001,
        "-normal": 0xBE00,  # -1.5
        "-max_finite": 0xFBFF,
    },
    torch.float32: {
        "+nan": 0x7FC00000,
        "+nan_payload": 0x7F800001,
        "+inf": 0x7F800000,
        "+min_subnormal": 0x00000001,
        "+max_subnormal": 0x007FFFFF,
        "+min_normal": 0x00800000,
        "+max_finite": 0x7F7FFFFF,
        "-zero": 0x80000000,
        "-nan": 0xFFC00000,
        "-inf": 0xFF800000,
        "-min_subnormal": 0x80000001,
        "-normal": 0xBFC00000,  # -1.5
        "-max_finite": 0xFF7FFFFF,
    },
    torch.float8_e4m3fn: {  # no infinities; NaN is S.1111.111 only
        "+nan": 0x7F,
        "+min_subnormal": 0x01,
        "+max_subnormal": 0x07,
        "+min_normal": 0x08,
        "+max_finite": 0x7E,  # 448
        "-zero": 0x80,
        "-nan": 0xFF,
        "-min_subnormal": 0x81,
        "-normal": 0xBC,  # -1.5
        "-max_finite": 0xFE,
    },
    torch.float8_e5m2: {
        "+nan": 0x7E,
        "+nan_payload": 0x7D,
        "+inf": 0x7C,
        "+min_subnormal": 0x01,
        "+max_subnormal": 0x03,
        "+min_normal": 0x04,
        "+max_finite": 0x7B,  # 57344
        "-zero": 0x80,
        "-nan": 0xFE,
        "-inf": 0xFC,
        "-min_subnormal": 0x81,
        "-normal": 0xBE,  # -1.5
        "-max_finite": 0xFB,
    },
}


def special_patterns(dtype: torch.dtype, sign: bool | None = None) -> list[int]:
    """Special bit patterns of ``dtype``: all, only sign-bit-set (True) or only sign-clear (False)."""
    bits = dtype_spec(dtype).bits
    return [
        p
        for p in SPECIALS[dtype].values()
        if sign is None or bool(p >> (bits - 1)) == sign
    ]


# --------------------------------------------------------------------------------------------
# Test inputs


def make_input(
    numel: int,
    dtype: torch.dtype,
    zero_fraction: float,
    generator: torch.Generator,
    specials: bool = True,
) -> torch.Tensor:
    """A 1-D ReLU-like tensor: exactly ``round(zero_fraction * numel)`` all-zero bit patterns.

    Every other element has a nonzero bit pattern: a positive value (|randn| scaled), or,
    with ``specials``, one of ``SPECIALS[dtype]`` (+-NaN with several payloads, +-Inf where the
    dtype has them, subnormals, -0.0, negative normals, +-largest finite). Sign-clear specials
    are sprinkled densely; sign-set ones sparsely (about one per 40000 elements, at least one
    of each when there is room), so that large inputs keep many tiles free of sign bits and
    sign packing still happens in them. Without ``specials`` no element has its sign bit set.
    """
    spec = dtype_spec(dtype)
    device = generator.device
    n_zero = round(zero_fraction * numel)
    values = (torch.randn(numel, generator=generator, device=device).abs_() * 4).to(dtype)
    bits = values.view(spec.bits_dtype).clone()
    one = torch.ones((), dtype=dtype, device=device).view(spec.bits_dtype)
    bits = torch.where(bits == 0, one, bits)  # values that rounded to zero
    order = torch.randperm(numel, generator=generator, device=device)
    bits[order[:n_zero]] = 0
    free = order[n_zero:]
    if specials and free.numel():
        positive = special_patterns(dtype, sign=False)
        negative = special_patterns(dtype, sign=True)
        n_pos = len(positive) * max(1, free.numel() // 1000)
        n_neg = max(len(negative), numel // 40000)
        chosen = free[torch.randperm(free.numel(), generator=generator, device=device)]
        # Alternate the two kinds at the front so that tiny inputs get some of each.
        patterns = []
        for i in range(max(n_pos, n_neg)):
            if i < n_neg:
                patterns.append(negative[i % len(negative)])
            if i < n_pos:
                patterns.append(positive[i % len(positive)])
        patterns = patterns[: chosen.numel()]
        special = from_patterns(patterns, dtype).view(spec.bits_dtype).to(device)
        bits[chosen[: len(patterns)]] = special
    return bits.view(dtype)


def random_bits(numel: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Uniformly random bit patterns (every NaN payload, subnormal, sign...) viewed as ``dtype``."""
    spec = dtype_spec(dtype)
    info = torch.iinfo(spec.bits_dtype)
    return torch.randint(
        info.min, info.max + 1, (numel,), dtype=spec.bits_dtype, generator=generator,
        device=generator.device,
    ).view(dtype)


def expected_tile_stats(x: torch.Tensor, sign_pack: bool, geometry: TileGeometry = TileGeometry()):
    """Per-tile nonzero counts (int64) and packed flags (bool), computed on ``x``'s device.

    A cheap stand-in for the full reference at sizes where NumPy would be slow (GPU tests).
    """
    spec = dtype_spec(x.dtype)
    bits = x.detach().reshape(-1).contiguous().view(spec.bits_dtype)
    tile = geometry.tile_size
    num_tiles = -(-bits.numel() // tile)
    padded = torch.zeros(num_tiles * tile, dtype=bits.dtype, device=bits.device)
    padded[: bits.numel()] = bits
    tiles = padded.view(num_tiles, tile)
    nonzero = tiles != 0
    counts = nonzero.sum(1)
    if sign_pack:
        packed = ~(nonzero & (tiles < 0)).any(1)  # the sign bit is the int view's sign
    else:
        packed = torch.zeros(num_tiles, dtype=torch.bool, device=bits.device)
    return counts, packed


# --------------------------------------------------------------------------------------------
# Reference encoding (NumPy, written from the format description)


@dataclass
class Reference:
    numel: int
    masks: np.ndarray  # uint32 [num_tiles, mask_words]
    counts: np.ndarray  # int64 [num_tiles]
    packed: np.ndarray  # bool [num_tiles]
    streams: list  # uint32 arrays, one per tile
    nbytes: int


def _pack_values(values: np.ndarray, bits: int, width: int) -> np.ndarray:
    """Values (unsigned, ``bits`` wide) as a stream of ``width``-bit fields, LSB first, in words."""
    if values.size == 0:
        return np.zeros(0, dtype=np.uint32)
    as_bytes = values.astype(f"<u{bits // 8}").view(np.uint8).reshape(values.size, bits // 8)
    fields = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :width].reshape(-1)
    words = tile_stream_words(values.size, width)
    padded = np.zeros(words * 32, dtype=np.uint8)
    padded[: fields.size] = fields
    return np.packbits(padded, bitorder="little").view("<u4").astype(np.uint32)


def reference_encoding(
    x: torch.Tensor, sign_pack: bool, geometry: TileGeometry = TileGeometry()
) -> Reference:
    spec = dtype_spec(x.dtype)
    flat = to_unsigned_numpy(x)
    numel, tile = flat.size, geometry.tile_size
    num_tiles = -(-numel // tile)
    padded = np.zeros(num_tiles * tile, dtype=flat.dtype)
    padded[:numel] = flat
    tiles = padded.reshape(num_tiles, tile)
    nonzero = tiles != 0
    sign = tiles >= (1 << (spec.bits - 1))
    counts = nonzero.sum(1).astype(np.int64)
    packed = np.asarray(sign_pack & ~(nonzero & sign).any(1), dtype=bool).reshape(num_tiles)
    masks = (
        np.packbits(nonzero, axis=1, bitorder="little").view("<u4").astype(np.uint32)
        if num_tiles
        else np.zeros((0, geometry.mask_words), dtype=np.uint32)
    )
    streams = [
        _pack_values(tiles[t][nonzero[t]], spec.bits, spec.packed_bits if packed[t] else spec.bits)
        for t in range(num_tiles)
    ]
    nbytes = compressed_nbytes(numel, spec, counts.tolist(), packed.tolist(), geometry)
    return Reference(numel, masks, counts, packed, streams, nbytes)


def check_against_reference(
    c, x: torch.Tensor, sign_pack: bool, geometry=TileGeometry(), zero_padding: bool = True
) -> Reference:
    """Every observable of ``c`` against the NumPy reference encoding of ``x``.

    Masks, packed flags, counts, nbytes, and each tile's words at ``base + offset``. Tile
    offsets are only required to lay the tiles out without gaps or overlaps (the Triton
    encoder may order tiles differently from the torch encoder).

    The bits of a tile's last word past its last value are padding that decoders ignore.
    Both encoders write them as zeros, so that a stream's bytes are defined; with
    ``zero_padding=False`` only the value bits are compared.
    """
    ref = reference_encoding(x, sign_pack, geometry)
    spec = dtype_spec(x.dtype)
    assert c.shape == x.shape and c.dtype == x.dtype and c.device == x.device
    assert c.sign_pack == sign_pack and c.geometry == geometry
    assert c.masks.dtype == torch.int32 and c.tile_words.dtype == torch.int32
    assert tuple(c.masks.shape) == (len(ref.counts), geometry.mask_words)
    assert tuple(c.tile_words.shape) == (len(ref.counts),)
    masks = c.masks.cpu().numpy().view(np.uint32)
    np.testing.assert_array_equal(masks, ref.masks, err_msg="masks")
    tile_words = c.tile_words.cpu().numpy().view(np.uint32).astype(np.int64)
    packed = (tile_words >> 31).astype(bool)
    np.testing.assert_array_equal(packed, ref.packed, err_msg="packed flags")
    assert c.nnz() == int(ref.counts.sum())
    assert c.nbytes == ref.nbytes
    assert c.dense_nbytes == ref.numel * spec.itemsize

    # Stream layout: tiles occupy disjoint runs [offset, offset + length) that tile the
    # tensor's stream [0, total) exactly; each run holds the tile's reference words.
    offsets = tile_words & MAX_TILE_OFFSET
    lengths = np.array([s.size for s in ref.streams], dtype=np.int64)
    total = int(lengths.sum())
    assert (offsets <= total).all()
    used = lengths > 0
    order = np.argsort(offsets[used], kind="stable")
    starts, ends = offsets[used][order], (offsets + lengths)[used][order]
    if starts.size:
        assert starts[0] == 0 and ends[-1] == total and (starts[1:] == ends[:-1]).all(), (
            "tile streams overlap or leave gaps"
        )
    base = int(c.base.item())
    words = c.values.words.cpu().numpy().view(np.uint32)
    assert base + total <= c.values.capacity
    if total:
        index = base + np.repeat(offsets, lengths) + (
            np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        )
        # Valid bits of each word: all, except in a tile's last word when the tile's values
        # end inside it.
        width = np.where(ref.packed, spec.packed_bits, spec.bits)
        tail_bits = (ref.counts * width) % 32
        valid = np.full(total, 0xFFFFFFFF, dtype=np.uint64)
        last = (np.cumsum(lengths) - 1)[used & (tail_bits > 0)]
        valid[last] = (1 << tail_bits[used & (tail_bits > 0)].astype(np.uint64)) - 1
        valid = valid.astype(np.uint32)
        got, want = words[index], np.concatenate(ref.streams)
        if zero_padding:
            np.testing.assert_array_equal(got, want, err_msg="value stream words")
        else:
            np.testing.assert_array_equal(got & valid, want, err_msg="value stream words")
    return ref


def compress_with(
    x: torch.Tensor,
    backend: str | None = None,
    *,
    sign_pack: bool = False,
    values: ValueBuffer | None = None,
    fixed: torch.Tensor | None = None,
    nonzeros: torch.Tensor | None = None,
    report: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
) -> CompressedTensor:
    """``compress`` through the allocators' entry point, with the append protocol's optional
    words (caller-provided fixed words, nonzero counter, report, start word)."""
    geometry = TileGeometry()
    spec = dtype_spec(x.dtype)
    if values is None:
        values = ValueBuffer(geometry.max_stream_words(x.numel(), spec.bits), x.device)
    if fixed is None:
        fixed = torch.empty(geometry.fixed_nbytes(x.numel()) // 4, dtype=torch.int32, device=x.device)
    codec = get_codec(backend, x.device)
    return compress_into(x.contiguous(), codec, geometry, values, fixed, sign_pack, nonzeros, report, base)


def compress_relu_of(x: torch.Tensor, backend: str | None = None, sign_pack: bool = False, square=None):
    """The ReLU of ``x``, compressed by the codec's ``encode`` with ``relu_square`` into a
    buffer of its own, and the square it wrote (into ``square`` if given)."""
    geometry, spec, codec = TileGeometry(), dtype_spec(x.dtype), get_codec(backend, x.device)
    values = ValueBuffer(geometry.max_stream_words(x.numel(), spec.bits), x.device)
    fixed = torch.empty(geometry.fixed_nbytes(x.numel()) // 4, dtype=torch.int32, device=x.device)
    base = torch.empty(1, dtype=torch.int64, device=x.device)
    square = torch.empty_like(x) if square is None else square
    stream, cursor, appends = values.words, values.cursor, values.appends
    codec.encode(x, fixed, stream, cursor, appends, base, spec, geometry, sign_pack, relu_square=square)
    return CompressedTensor(x.shape, x.dtype, sign_pack, geometry, fixed, values, base, values.generation), square


def decode_relu_square_backward(c: CompressedTensor, backend: str | None, square_grad: torch.Tensor):
    """``c`` (a ReLU's output) decoded by the codec's ``decode`` with ``square_grad``: the
    square and the gradient of the ReLU's input it wrote."""
    square, grad_input = (torch.empty(c.shape, dtype=c.dtype, device=c.fixed.device) for _ in range(2))
    codec = get_codec(backend, c.fixed.device)
    spec = dtype_spec(c.dtype)
    codec.decode(c.fixed, c.values.words, c.base, grad_input, spec, c.geometry, c.sign_pack, square, square_grad)
    return square, grad_input


def below_zero_cleared(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every element below zero replaced by +0.0 (``-0.0`` and NaNs are not below)."""
    return torch.where(x < 0, torch.zeros_like(x), x)


def check_successive_appends(backend: str, device: str = "cpu") -> None:
    """Appends to one buffer follow each other: each starts at the cursor its predecessor
    left, reports its end plus one, and leaves the encoders' scratch counters at zero."""
    g = generator("appends", backend, device)
    cases = [(5000, torch.bfloat16, True), (0, torch.float32, False), (3 * 4096 + 1, torch.float8_e4m3fn, False)]
    cases += [(777, torch.float16, True), (2 * 4096, torch.float32, True)]
    geometry = TileGeometry()
    buf = ValueBuffer(sum(geometry.max_stream_words(n, dtype.itemsize * 8) for n, dtype, _ in cases), device)
    for numel, dtype, sign_pack in cases:
        x = make_input(numel, dtype, 0.5, g).to(device)
        report = torch.zeros(1, dtype=torch.int64, pin_memory=device == "cuda")
        before = int(buf.cursor)
        c = compress_with(x, backend, sign_pack=sign_pack, values=buf, report=report)
        if device == "cuda":
            torch.cuda.synchronize()
        assert int(c.base) == before
        assert int(report) - 1 == int(buf.cursor) == before + int(c.stream_words())
        assert buf.appends.tolist() == [0, 0]
        assert_bitwise_equal(decompress(c, backend=backend), x)


class NoRoomForBuffers:
    """``torch`` as ``bitsparse.allocator.arena`` sees it (set it there with monkeypatch), but
    for a device without room for a buffer: the arena's ``torch.empty`` of int32 words on its
    device raises as PyTorch's caching allocator does when the device is full. Host memory,
    where a first step measures, is still given."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kwargs):
        if kwargs.get("dtype") is torch.int32 and "device" in kwargs:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return torch.empty(*size, **kwargs)
