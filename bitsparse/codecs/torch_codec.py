"""The reference codec in plain PyTorch: vectorised, any device, no host synchronization.

It favours clarity over speed: every tile is expanded to ``tile_size`` int64 lanes. The
value stream is written in tile order, so its bytes are deterministic.
"""

from __future__ import annotations

import torch

from bitsparse.codecs import relu
from bitsparse.format import (
    MAX_TILE_OFFSET,
    PACKED_TILE_FLAG,
    WORD_BITS,
    DTypeSpec,
    TileGeometry,
    tile_stream_words,
)

name = "torch"

_BYTE_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)


def check_device(device: torch.device) -> None:
    """Any device PyTorch supports will do."""


def unsigned(bits: torch.Tensor, width: int) -> torch.Tensor:
    """The bit patterns of ``bits`` (any signed integer dtype) as nonnegative int64."""
    return bits.long() & ((1 << width) - 1)


def wrap_signed(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret nonnegative int64 bit patterns as the signed integer ``dtype`` of their width."""
    width = torch.iinfo(dtype).bits
    return torch.where(values >= 1 << (width - 1), values - (1 << width), values).to(dtype)


def tile_counts(masks: torch.Tensor) -> torch.Tensor:
    """Nonzero elements per tile (int64 ``[num_tiles]``), counted from the bitmasks."""
    table = _BYTE_POPCOUNT.to(masks.device)
    per_byte = table[masks.contiguous().view(torch.uint8).int()]
    return per_byte.view(masks.shape[0], 4 * masks.shape[1]).sum(1, dtype=torch.int64)


def tile_widths(tile_words: torch.Tensor, spec: DTypeSpec) -> torch.Tensor:
    """Value width in bits of each tile (int64), read from the tile words' packed flag."""
    packed = (tile_words.long() & PACKED_TILE_FLAG) != 0
    return torch.where(packed, spec.packed_bits, spec.bits)


def _tile_bits(masks: torch.Tensor, geometry: TileGeometry) -> torch.Tensor:
    """The masks expanded to one bool per element, ``[num_tiles, tile_size]``."""
    shifts = torch.arange(WORD_BITS, device=masks.device)
    bits = (unsigned(masks, WORD_BITS).unsqueeze(-1) >> shifts) & 1
    return bits.view(masks.shape[0], geometry.tile_size).bool()


def split_fixed(fixed: torch.Tensor, geometry: TileGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """The masks (``[num_tiles, mask_words]``) and the tile words (``[num_tiles]``) that
    ``fixed`` holds, one after the other."""
    num_tiles = fixed.numel() // (geometry.mask_words + 1)
    masks = fixed[: num_tiles * geometry.mask_words].view(num_tiles, geometry.mask_words)
    return masks, fixed[num_tiles * geometry.mask_words :]


def _tiles(x: torch.Tensor, spec: DTypeSpec, geometry: TileGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s bit patterns as nonnegative int64, ``[num_tiles, tile_size]`` (the last tile
    padded with zeros), and which of them are stored (nonzero)."""
    num_tiles, tile = geometry.num_tiles(x.numel()), geometry.tile_size
    bits = x.reshape(-1).view(spec.bits_dtype)
    padded = torch.zeros(num_tiles * tile, dtype=torch.int64, device=x.device)
    padded[: bits.numel()] = unsigned(bits, spec.bits)
    padded = padded.view(num_tiles, tile)
    return padded, padded != 0


def _stream_lengths(padded, nonzero, spec: DTypeSpec, sign_pack: bool):
    """Per tile: the number of stored values, whether they are sign-packed, their width in
    bits and the stream words they take."""
    counts = nonzero.sum(1)
    if sign_pack:
        negative = (padded >> (spec.bits - 1)).bool()
        packed = ~(nonzero & negative).any(1)
    else:
        packed = torch.zeros(padded.shape[0], dtype=torch.bool, device=padded.device)
    width = torch.where(packed, spec.packed_bits, spec.bits)
    return counts, packed, width, (counts * width + WORD_BITS - 1) // WORD_BITS


def relu_and_square(x: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
    """``codecs.relu(x)``, with its elementwise square written into ``square``: computed in
    float32, rounded to the dtype (nearest even)."""
    x = relu(x)
    wide = x.float()
    square.copy_(wide * wide)
    return x


def _measured_tile_words(x, spec, geometry, sign_pack, relu_square) -> torch.Tensor:
    """The stream words of each tile of ``x`` (of its ReLU, with ``relu_square`` written)."""
    if relu_square is not None:
        x = relu_and_square(x, relu_square)
    padded, nonzero = _tiles(x, spec, geometry)
    return _stream_lengths(padded, nonzero, spec, sign_pack)[3]


def measure(x, cursor, appends, spec, geometry, sign_pack, report=None, relu_square=None):
    cursor.add_(_measured_tile_words(x, spec, geometry, sign_pack, relu_square).sum())
    if report is not None:
        report.copy_(cursor + 1, non_blocking=True)


def measure_tiles(x, tile_words, spec, geometry, sign_pack, relu_square=None):
    tile_words.copy_(_measured_tile_words(x, spec, geometry, sign_pack, relu_square), non_blocking=True)


def encode(
    x, fixed, stream, cursor, appends, base, spec, geometry, sign_pack, nonzeros=None, report=None, relu_square=None
):
    # One vectorised pass claims every tile's words at once: ``appends`` is not needed.
    if relu_square is not None:
        x = relu_and_square(x, relu_square)
    masks, tile_words = split_fixed(fixed, geometry)
    num_tiles, tile = masks.shape[0], geometry.tile_size
    device = x.device
    base.copy_(cursor)
    padded, nonzero = _tiles(x, spec, geometry)

    shifts = torch.arange(WORD_BITS, device=device)
    mask_words = (nonzero.view(num_tiles, -1, WORD_BITS).long() << shifts).sum(-1)
    masks.copy_(wrap_signed(mask_words, torch.int32))

    counts, packed, width, lengths = _stream_lengths(padded, nonzero, spec, sign_pack)
    if nonzeros is not None:
        nonzeros.add_(counts.sum())
    offsets = lengths.cumsum(0) - lengths
    tile_words.copy_(wrap_signed(offsets | (packed.long() << 31), torch.int32))

    # Compact each tile's values to the front, in position order (adding zeros elsewhere).
    rank = nonzero.cumsum(1) - 1
    compact = torch.zeros_like(padded).scatter_add_(1, rank.clamp_min(0), padded)
    # Value k of a tile starts at bit k * width; it spills into the next word at most.
    bit = torch.arange(tile, device=device) * width[:, None]
    value = compact & ((1 << width[:, None]) - 1)
    words_per_tile = tile_stream_words(tile, spec.bits)
    packed_words = torch.zeros(num_tiles, words_per_tile + 1, dtype=torch.int64, device=device)
    packed_words.scatter_add_(1, bit >> 5, (value << (bit & 31)) & 0xFFFFFFFF)
    packed_words.scatter_add_(1, (bit >> 5) + 1, value >> (WORD_BITS - (bit & 31)))

    # Append to the stream; a tile that does not fit below the guard word is not written.
    capacity = stream.numel() - 1
    start = base + offsets
    fits = start + lengths <= capacity
    column = torch.arange(words_per_tile, device=device)
    dest = start[:, None] + column
    dest = torch.where((column < lengths[:, None]) & fits[:, None], dest, capacity)
    stream.index_put_((dest.flatten(),), wrap_signed(packed_words[:, :-1], torch.int32).flatten())
    cursor.add_(lengths.sum())
    if report is not None:
        report.copy_(cursor + 1, non_blocking=True)


def relu_square_backward(r, square_grad, square, grad_input, relu_input=False):
    # A sixteenth of the tensor at a time (2**16 elements at least), in place where it can:
    # the float32 temporaries, about 10 bytes an element of a piece, stay a small part of
    # what the tensors hold.
    piece = max(-(-r.numel() // 16), 1 << 16)
    pieces = (t.view(-1).split(piece) for t in (r, square_grad, square, grad_input))
    for r_piece, grad_piece, square_piece, grad_input_piece in zip(*pieces):
        wide = (relu(r_piece) if relu_input else r_piece).float()  # r itself for float32: read only
        square_piece.copy_(wide * wide)
        product = torch.mul(wide, 2.0).mul_(grad_piece)
        grad_input_piece.copy_(product.masked_fill_(wide <= 0, 0.0))


def decode(fixed, stream, base, out, spec, geometry, sign_pack, square=None, square_grad=None):
    if square_grad is not None:
        restored = torch.empty_like(out)
        decode(fixed, stream, base, restored, spec, geometry, sign_pack)
        relu_square_backward(restored, square_grad, square, out)
        return
    masks, tile_words = split_fixed(fixed, geometry)
    num_tiles = masks.shape[0]
    if num_tiles == 0:
        return
    nonzero = _tile_bits(masks, geometry)
    rank = (nonzero.cumsum(1) - 1).clamp_min(0)
    width = tile_widths(tile_words, spec)[:, None]
    offset = (tile_words.long() & MAX_TILE_OFFSET)[:, None]
    bit = rank * width
    first = base + offset + (bit >> 5)
    last = stream.numel() - 1
    low = unsigned(stream[first.clamp(max=last)], WORD_BITS)
    high = unsigned(stream[(first + 1).clamp(max=last)], WORD_BITS)
    shift = bit & 31
    value = ((low >> shift) | (high << (WORD_BITS - shift))) & ((1 << width) - 1)
    value = torch.where(nonzero, value, 0).flatten()[: out.numel()]
    out.view(spec.bits_dtype).view(-1).copy_(wrap_signed(value, spec.bits_dtype))
    if square is not None:
        torch.square(out, out=square)


def encoder(stream, cursor, appends, spec, geometry, sign_pack, numel, count_nonzeros, report, relu_square=False):
    def encode_into(x, fixed, base, nonzeros=None, report_word=None, square=None):
        encode(x, fixed, stream, cursor, appends, base, spec, geometry, sign_pack, nonzeros, report_word, square)

    return encode_into


def decoder(stream, spec, geometry, sign_pack, numel):
    def decode_into(fixed, base, out, square=None, square_grad=None):
        decode(fixed, stream, base, out, spec, geometry, sign_pack, square, square_grad)

    return decode_into
