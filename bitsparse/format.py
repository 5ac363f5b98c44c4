"""The BitSparse storage format: tile geometry, value encodings and exact sizes.

This module is the single source of truth for the layout described in ``docs/format.md``.
Both codecs (``bitsparse.codecs.torch_codec`` and ``bitsparse.codecs.triton_codec``) write
and read exactly this layout, so either can decode what the other encoded.

In short, a tensor of ``numel`` elements is flattened in row-major order and cut into
``num_tiles = ceil(numel / tile_size)`` tiles. Each tile stores

* a bitmask of ``tile_size / 32`` little-endian 32-bit words; bit ``i`` (least significant
  first) of word ``w`` is set when element ``32 * w + i`` of the tile is nonzero, that is,
  when its bit pattern is not all zeros (so ``-0.0`` is a stored value);
* a 32-bit tile word: bits 0-30 hold the offset, in 32-bit words, of the tile's first value
  in the tensor's value stream; bit 31 is set when the tile's values are sign-packed;
* its nonzero values in position order, as a bit stream that starts at that word: value
  ``k`` of the tile occupies stream bits ``[k * b, (k + 1) * b)`` counted from the tile's
  first word, least significant bit first, where ``b`` is the dtype's width (raw) or the
  width less the sign bit (sign-packed). Each tile's values fill whole 32-bit words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

WORD_BITS = 32
"""Width of a mask word, a tile word and a value-stream word."""

PACKED_TILE_FLAG = 1 << 31
"""Bit of a tile word that marks a sign-packed tile."""

MAX_TILE_OFFSET = (1 << 31) - 1
"""Largest word offset a tile word can hold: a tensor's value stream is at most 8 GiB."""

DEFAULT_TILE_SIZE = 4096


@dataclass(frozen=True)
class DTypeSpec:
    """How one floating dtype is stored.

    Attributes:
        dtype: the floating dtype.
        bits_dtype: the integer dtype of the same width whose view gives the value's bits.
        bits: width of a raw value in bits.
    """

    dtype: torch.dtype
    bits_dtype: torch.dtype
    bits: int

    @property
    def packed_bits(self) -> int:
        """Width of a sign-packed value: the sign bit is dropped."""
        return self.bits - 1

    @property
    def itemsize(self) -> int:
        return self.bits // 8


SUPPORTED_DTYPES: dict[torch.dtype, DTypeSpec] = {
    spec.dtype: spec
    for spec in (
        DTypeSpec(torch.float32, torch.int32, 32),
        DTypeSpec(torch.float16, torch.int16, 16),
        DTypeSpec(torch.bfloat16, torch.int16, 16),
        DTypeSpec(torch.float8_e4m3fn, torch.int8, 8),
        DTypeSpec(torch.float8_e5m2, torch.int8, 8),
    )
}


def dtype_spec(dtype: torch.dtype) -> DTypeSpec:
    """Return the storage description of ``dtype``.

    Raises:
        TypeError: ``dtype`` is not one of the supported floating dtypes.
    """
    try:
        return SUPPORTED_DTYPES[dtype]
    except KeyError:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(
            f"bitsparse stores {names}; got a tensor of dtype {dtype}. "
            "Convert it (for instance with .float()) or leave it uncompressed."
        ) from None


@dataclass(frozen=True)
class TileGeometry:
    """How a flattened tensor is cut into tiles: runs of ``tile_size`` consecutive elements.

    ``tile_size`` is a power of two between 32 and 65536 (the Triton kernels work on
    power-of-two blocks, and one mask word covers 32 elements).
    """

    tile_size: int = DEFAULT_TILE_SIZE

    def __post_init__(self):
        size = self.tile_size
        if not isinstance(size, int) or size < 32 or size > 65536 or size & (size - 1):
            raise ValueError(f"tile_size must be a power of two from 32 to 65536, got {size!r}")

    @property
    def mask_words(self) -> int:
        """32-bit mask words per tile."""
        return self.tile_size // WORD_BITS

    def num_tiles(self, numel: int) -> int:
        return -(-numel // self.tile_size)

    def fixed_nbytes(self, numel: int) -> int:
        """Bytes of the parts whose size is known from the shape alone: masks and tile words."""
        return self.num_tiles(numel) * (4 * self.mask_words + 4)

    def max_stream_words(self, numel: int, bits: int) -> int:
        """Value-stream words a tensor of ``numel`` elements can need at most (no zeros, raw)."""
        full, rest = divmod(numel, self.tile_size)
        return full * tile_stream_words(self.tile_size, bits) + tile_stream_words(rest, bits)


def tile_stream_words(count: int, bits: int) -> int:
    """Words one tile's values take: ``count`` values of ``bits`` bits, rounded up to a word."""
    return -(-count * bits // WORD_BITS)


def compressed_nbytes(
    numel: int,
    spec: DTypeSpec,
    tile_counts: Sequence[int],
    tile_packed: Sequence[bool],
    geometry: TileGeometry = TileGeometry(),
) -> int:
    """Exact bytes of a compressed tensor, given each tile's nonzero count and encoding.

    ``nbytes = num_tiles * (tile_size / 8 + 4) + 4 * sum_t ceil(count_t * b_t / 32)`` with
    ``b_t`` the tile's value width (``spec.packed_bits`` for packed tiles, else ``spec.bits``).
    """
    stream_words = sum(
        tile_stream_words(count, spec.packed_bits if packed else spec.bits)
        for count, packed in zip(tile_counts, tile_packed, strict=True)
    )
    return geometry.fixed_nbytes(numel) + 4 * stream_words


def break_even_zero_fraction(
    spec: DTypeSpec, sign_pack: bool = False, geometry: TileGeometry = TileGeometry()
) -> float:
    """Fraction of zeros above which a full tile is smaller compressed than dense.

    Ignores the rounding of each tile's values to whole words (at most 4 bytes a tile).
    """
    bits = spec.packed_bits if sign_pack else spec.bits
    overhead_bits = WORD_BITS * (geometry.mask_words + 1)
    dense_bits = geometry.tile_size * spec.bits
    # dense_bits = overhead_bits + (1 - z) * tile_size * bits, solved for z.
    return max(0.0, 1.0 - (dense_bits - overhead_bits) / (geometry.tile_size * bits))


__all__ = [
    "WORD_BITS",
    "PACKED_TILE_FLAG",
    "MAX_TILE_OFFSET",
    "DEFAULT_TILE_SIZE",
    "DTypeSpec",
    "SUPPORTED_DTYPES",
    "dtype_spec",
    "TileGeometry",
    "tile_stream_words",
    "compressed_nbytes",
    "break_even_zero_fraction",
]
