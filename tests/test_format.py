"""The format module: dtype descriptions, tile geometry and exact sizes."""

import dataclasses
import math

import pytest
import torch
from helpers import DTYPE_IDS, dtype_id

from bitsparse import format as fmt
from bitsparse.format import (
    PACKED_TILE_FLAG,
    SUPPORTED_DTYPES,
    TileGeometry,
    break_even_zero_fraction,
    compressed_nbytes,
    dtype_spec,
    tile_stream_words,
)

SUPPORTED_NAMES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")

EXPECTED_SPECS = {
    torch.float32: (torch.int32, 32, 31, 4),
    torch.float16: (torch.int16, 16, 15, 2),
    torch.bfloat16: (torch.int16, 16, 15, 2),
    torch.float8_e4m3fn: (torch.int8, 8, 7, 1),
    torch.float8_e5m2: (torch.int8, 8, 7, 1),
}


def test_constants():
    assert fmt.WORD_BITS == 32
    assert PACKED_TILE_FLAG == 0x8000_0000
    assert fmt.MAX_TILE_OFFSET == 0x7FFF_FFFF
    assert fmt.DEFAULT_TILE_SIZE == 4096
    assert TileGeometry().tile_size == 4096


def test_supported_dtypes_are_exactly_the_five_floats():
    assert set(SUPPORTED_DTYPES) == set(EXPECTED_SPECS)


@pytest.mark.parametrize("dtype", list(EXPECTED_SPECS), ids=dtype_id)
def test_dtype_spec(dtype):
    bits_dtype, bits, packed_bits, itemsize = EXPECTED_SPECS[dtype]
    spec = dtype_spec(dtype)
    assert spec.dtype == dtype
    assert spec.bits_dtype == bits_dtype
    assert spec.bits == bits == torch.finfo(dtype).bits
    assert spec.packed_bits == packed_bits
    assert spec.itemsize == itemsize == torch.empty(0, dtype=dtype).element_size()
    # The integer view really is of the same width (compress relies on .view(bits_dtype)).
    assert torch.iinfo(bits_dtype).bits == bits


@pytest.mark.parametrize(
    "dtype",
    [torch.int32, torch.int64, torch.int8, torch.uint8, torch.float64, torch.bool,
     torch.complex64, torch.complex128],
    ids=str,
)
def test_dtype_spec_rejects_unsupported(dtype):
    with pytest.raises(TypeError, match=f"got a tensor of dtype {dtype}") as info:
        dtype_spec(dtype)
    message = str(info.value)
    for name in SUPPORTED_NAMES:
        assert name in message
    assert "torch." not in message.split(";")[0]  # the list reads "float32, float16, ..."


@pytest.mark.parametrize("size", [32, 64, 128, 256, 1024, 4096, 8192, 32768, 65536])
def test_tile_geometry_accepts_powers_of_two(size):
    g = TileGeometry(size)
    assert g.tile_size == size
    assert g.mask_words == size // 32


@pytest.mark.parametrize(
    "size",
    [0, 1, 2, 16, 31, 33, 48, 96, 1000, 4095, 4097, 65535, 65537, 131072, -32, -4096, 4096.0, "4096", None],
    ids=repr,
)
def test_tile_geometry_rejects(size):
    with pytest.raises(ValueError, match="tile_size must be a power of two from 32 to 65536"):
        TileGeometry(size)


def test_tile_geometry_is_hashable_and_frozen():
    assert TileGeometry(256) == TileGeometry(256)
    assert hash(TileGeometry(256)) == hash(TileGeometry(256))
    assert TileGeometry(256) != TileGeometry(512)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TileGeometry(256).tile_size = 512


@pytest.mark.parametrize(
    "numel, tiles",
    [(0, 0), (1, 1), (4095, 1), (4096, 1), (4097, 2), (3 * 4096 + 17, 4), (10**6, 245), (2**31 - 1, 2**19)],
)
def test_num_tiles_default(numel, tiles):
    g = TileGeometry()
    assert g.num_tiles(numel) == tiles
    # 4096 / 8 mask bytes + one 4-byte tile word per tile.
    assert g.fixed_nbytes(numel) == tiles * (512 + 4)


@pytest.mark.parametrize("size", [32, 256, 65536])
def test_num_tiles_other_geometries(size):
    g = TileGeometry(size)
    for numel in (0, 1, size - 1, size, size + 1, 7 * size + 3):
        assert g.num_tiles(numel) == math.ceil(numel / size)
        assert g.fixed_nbytes(numel) == math.ceil(numel / size) * (size // 8 + 4)


@pytest.mark.parametrize(
    "count, bits, words",
    [
        (0, 16, 0), (1, 16, 1), (2, 16, 1), (3, 16, 2),
        (1, 15, 1), (2, 15, 1), (3, 15, 2), (32, 15, 15), (33, 15, 16),
        (1, 8, 1), (4, 8, 1), (5, 8, 2), (32, 7, 7), (33, 7, 8),
        (1, 32, 1), (7, 32, 7), (1, 31, 1), (32, 31, 31), (33, 31, 32),
        (410, 16, 205), (410, 15, 193), (4096, 16, 2048), (4096, 15, 1920),
    ],
)
def test_tile_stream_words(count, bits, words):
    assert tile_stream_words(count, bits) == words == math.ceil(count * bits / 32)


@pytest.mark.parametrize("dtype", list(EXPECTED_SPECS), ids=dtype_id)
@pytest.mark.parametrize("size", [32, 4096])
def test_max_stream_words(dtype, size):
    g, spec = TileGeometry(size), dtype_spec(dtype)
    for numel in (0, 1, 3, size - 1, size, size + 1, 3 * size + 17):
        full, rest = divmod(numel, size)
        expected = full * math.ceil(size * spec.bits / 32) + math.ceil(rest * spec.bits / 32)
        assert g.max_stream_words(numel, spec.bits) == expected
        # It bounds the stream of any tensor of that size (every element nonzero, raw).
        counts = [size] * full + ([rest] if rest else [])
        assert compressed_nbytes(numel, spec, counts, [False] * len(counts), g) == (
            g.fixed_nbytes(numel) + 4 * expected
        )


def test_compressed_nbytes_worked_example_bf16():
    """One 4096-element bf16 tile holding 410 nonzeros (90% zeros)."""
    spec = dtype_spec(torch.bfloat16)
    # 512 mask bytes + 4 tile-word bytes + ceil(410 * 16 / 32) = 205 words.
    assert compressed_nbytes(4096, spec, [410], [False]) == 512 + 4 + 4 * 205 == 1336
    # Sign packed: ceil(410 * 15 / 32) = ceil(192.1875) = 193 words.
    assert compressed_nbytes(4096, spec, [410], [True]) == 512 + 4 + 4 * 193 == 1288
    assert 4096 * 2 == 8192  # the dense size it is compared against


def test_compressed_nbytes_mixed_tiles():
    spec = dtype_spec(torch.float32)
    numel = 3 * 4096 + 17  # 4 tiles, the last one 17 elements long
    counts, packed = [4096, 0, 100, 17], [False, True, True, False]
    stream = 4096 + 0 + math.ceil(100 * 31 / 32) + 17
    assert compressed_nbytes(numel, spec, counts, packed) == 4 * (512 + 4) + 4 * stream
    fp8 = dtype_spec(torch.float8_e5m2)
    assert compressed_nbytes(100, fp8, [5], [True], TileGeometry(128)) == 16 + 4 + 4 * 2
    assert compressed_nbytes(100, fp8, [5], [False], TileGeometry(128)) == 16 + 4 + 4 * 2
    assert compressed_nbytes(100, fp8, [9], [True], TileGeometry(128)) == 16 + 4 + 4 * 2
    assert compressed_nbytes(100, fp8, [9], [False], TileGeometry(128)) == 16 + 4 + 4 * 3
    assert compressed_nbytes(0, fp8, [], []) == 0


def test_compressed_nbytes_checks_lengths():
    spec = dtype_spec(torch.float16)
    with pytest.raises(ValueError):
        compressed_nbytes(10, spec, [1, 2], [False])


@pytest.mark.parametrize(
    "dtype, sign_pack, approx",
    [
        (torch.bfloat16, False, 0.063),
        (torch.float16, False, 0.063),
        (torch.float32, False, 0.0315),
        (torch.float8_e4m3fn, False, 0.126),
        (torch.float8_e5m2, False, 0.126),
        (torch.bfloat16, True, 0.000521),
        (torch.float32, True, 0.000252),
        (torch.float8_e4m3fn, True, 0.001116),
    ],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
def test_break_even_zero_fraction(dtype, sign_pack, approx):
    spec = dtype_spec(dtype)
    g = TileGeometry()
    z = break_even_zero_fraction(spec, sign_pack)
    assert z == pytest.approx(approx, rel=0.01)
    bits = spec.packed_bits if sign_pack else spec.bits
    dense_bits = g.tile_size * spec.bits
    # The two sides of "compressed == dense" at z (word rounding ignored).
    compressed_bits = 32 * (g.mask_words + 1) + (1 - z) * g.tile_size * bits
    assert compressed_bits == pytest.approx(dense_bits, rel=1e-12)
    # With word rounding: a tile with a few more zeros than the break-even point is smaller
    # than dense, one with a few fewer is larger. Rounding adds at most one word, i.e.
    # ceil(32 / bits) values.
    at = (1 - z) * g.tile_size  # nonzeros at break-even
    fewer = math.floor(at) - math.ceil(32 / bits) - 1
    more = math.ceil(at) + 1
    dense_bytes = g.tile_size * spec.itemsize
    assert compressed_nbytes(g.tile_size, spec, [fewer], [sign_pack]) < dense_bytes
    assert compressed_nbytes(g.tile_size, spec, [more], [sign_pack]) > dense_bytes


def test_break_even_worked_numbers():
    bf16 = dtype_spec(torch.bfloat16)
    # 4096 * 16 = 65536 dense bits; overhead 32 * (128 + 1) = 4128 bits.
    assert break_even_zero_fraction(bf16) == pytest.approx(4128 / 65536)
    assert break_even_zero_fraction(bf16, sign_pack=True) == pytest.approx(1 - 61408 / 61440)
    # The 90%-zeros example above is far past break-even: 1336 < 8192.
    assert compressed_nbytes(4096, bf16, [410], [False]) < 8192


@pytest.mark.parametrize("size", [32, 256, 65536])
@pytest.mark.parametrize("dtype", list(EXPECTED_SPECS), ids=dtype_id)
def test_break_even_other_geometries(size, dtype):
    spec, g = dtype_spec(dtype), TileGeometry(size)
    for sign_pack in (False, True):
        z = break_even_zero_fraction(spec, sign_pack, g)
        bits = spec.packed_bits if sign_pack else spec.bits
        assert 0 < z < 1
        assert 32 * (g.mask_words + 1) + (1 - z) * size * bits == pytest.approx(size * spec.bits)
    # Smaller tiles pay relatively more overhead.
    if size > 32:
        assert break_even_zero_fraction(spec, False, g) < break_even_zero_fraction(spec, False, TileGeometry(32))
