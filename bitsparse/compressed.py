"""The public codec API: ``compress``, ``decompress``, ``CompressedTensor`` and ``ValueBuffer``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitsparse.codecs import Codec, get_codec, torch_codec
from bitsparse.format import (
    MAX_TILE_OFFSET,
    WORD_BITS,
    DTypeSpec,
    TileGeometry,
    dtype_spec,
)

MAX_NUMEL = (1 << 31) - 1
"""Largest tensor a single ``compress`` call takes (the kernels index elements with int32)."""


class ValueBuffer:
    """An append-only run of 32-bit device words that value streams are written into.

    ``words`` holds ``capacity + 1`` int32 words; the last one is a guard that is never
    handed out. ``cursor`` (int64 ``[1]``, on the same device) is the next free word.
    Encoders advance the cursor on the device, so appending never waits for the GPU; a tensor
    whose values did not fit advances it past ``capacity`` (see ``CompressedTensor.fits``).
    ``appends`` (int64 ``[2]``, zero between appends) is the encoders' scratch: the words an
    append has claimed so far and how many of its programs finished. Appends to one buffer
    must therefore follow each other in stream order (one CUDA stream, as an arena's do).

    Args:
        capacity_words: usable words of the new buffer.
        device: where the buffer lives.
    """

    def __init__(self, capacity_words: int, device: torch.device | str | None = None):
        if capacity_words < 0:
            raise ValueError(f"capacity_words must be >= 0, got {capacity_words}")
        self.words = torch.empty(capacity_words + 1, dtype=torch.int32, device=device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)
        self.appends = torch.zeros(2, dtype=torch.int64, device=device)

    @classmethod
    def wrap(cls, words: torch.Tensor, cursor: torch.Tensor) -> "ValueBuffer":
        """A buffer over existing ``words`` (its last word is the guard) and ``cursor``.

        An arena hands out such views of its one allocation; they share its cursor.
        """
        if words.dtype != torch.int32 or words.dim() != 1 or words.numel() < 1:
            raise ValueError("words must be a non-empty 1-D int32 tensor")
        if cursor.dtype != torch.int64 or cursor.shape != (1,) or cursor.device != words.device:
            raise ValueError("cursor must be an int64 tensor of shape (1,) on the words' device")
        buffer = cls.__new__(cls)
        buffer.words, buffer.cursor = words, cursor
        buffer.appends = torch.zeros(2, dtype=torch.int64, device=words.device)
        return buffer

    @property
    def capacity(self) -> int:
        """Usable words."""
        return self.words.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.words.device

    def reset(self) -> None:
        """Forget every stream written so far (asynchronously, on the current stream)."""
        self.cursor.zero_()


@dataclass(eq=False, slots=True)
class CompressedTensor:
    """A tensor stored in the BitSparse format (``docs/format.md``). Treat it as read-only.

    Attributes:
        shape, dtype: those of the original tensor.
        sign_pack: whether sign packing was requested (tiles holding a value with its sign
            bit set are stored raw regardless).
        geometry: the tile geometry.
        fixed: int32 ``[num_tiles * (tile_size / 32 + 1)]``: the nonzero bitmasks, then the
            tile words (see ``masks`` and ``tile_words``).
        values: the buffer holding the value stream (shared with other tensors in an arena).
        base: int64 ``[1]``, the word of ``values`` where this tensor's stream starts.
    """

    shape: torch.Size
    dtype: torch.dtype
    sign_pack: bool
    geometry: TileGeometry
    fixed: torch.Tensor
    values: ValueBuffer
    base: torch.Tensor

    @property
    def masks(self) -> torch.Tensor:
        """int32 ``[num_tiles, tile_size / 32]``, the nonzero bitmasks (a view of ``fixed``)."""
        return torch_codec.split_fixed(self.fixed, self.geometry)[0]

    @property
    def tile_words(self) -> torch.Tensor:
        """int32 ``[num_tiles]``, each tile's stream offset and packed flag (a view of ``fixed``)."""
        return torch_codec.split_fixed(self.fixed, self.geometry)[1]

    @property
    def device(self) -> torch.device:
        return self.fixed.device

    @property
    def spec(self) -> DTypeSpec:
        return dtype_spec(self.dtype)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def num_tiles(self) -> int:
        return self.geometry.num_tiles(self.numel)

    @property
    def dense_nbytes(self) -> int:
        """Bytes the dense tensor takes."""
        return self.numel * self.spec.itemsize

    def stream_words(self) -> torch.Tensor:
        """Words of this tensor's value stream, as an int64 device tensor (no synchronization)."""
        counts = torch_codec.tile_counts(self.masks)
        widths = torch_codec.tile_widths(self.tile_words, self.spec)
        return ((counts * widths + WORD_BITS - 1) // WORD_BITS).sum()

    @property
    def nbytes(self) -> int:
        """Bytes of this tensor in the format: masks, tile words and its value stream.

        Reads the stream length from the device, so it synchronizes.
        """
        return self.geometry.fixed_nbytes(self.numel) + 4 * int(self.stream_words())

    def nnz(self) -> int:
        """Number of stored (nonzero-bit-pattern) elements. Synchronizes."""
        return int(torch_codec.tile_counts(self.masks).sum())

    def fits(self) -> bool:
        """Whether every tile's values were written: false when the buffer ran out. Synchronizes."""
        end = self.base + self.stream_words()
        return bool(end <= self.values.capacity)


def _check_tensor(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"compress expects a torch.Tensor, got {type(x).__name__}")
    if x.is_sparse or x.layout != torch.strided:
        raise ValueError(f"compress expects a dense (strided) tensor, got layout {x.layout}")
    if x.numel() > MAX_NUMEL:
        raise ValueError(
            f"compress takes at most {MAX_NUMEL} elements at a time, got {x.numel()}; "
            "split the tensor and compress the parts"
        )
    return x


def compress(
    x: torch.Tensor,
    *,
    sign_pack: bool = False,
    backend: str | None = None,
    geometry: TileGeometry | None = None,
    values: ValueBuffer | None = None,
    fixed: torch.Tensor | None = None,
    nonzeros: torch.Tensor | None = None,
    report: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
) -> CompressedTensor:
    """Store ``x`` losslessly as a bitmask of its nonzero elements and their values.

    Never synchronizes with the host: tile offsets and the stream's end stay on the device.

    Args:
        x: a float32, float16, bfloat16, float8_e4m3fn or float8_e5m2 tensor of any shape,
            contiguous or not. An element is stored when its bit pattern is not all zeros,
            so ``-0.0``, NaN and subnormals come back exactly.
        sign_pack: drop the sign bit of every stored value (15 bits for 16-bit dtypes, 31 for
            float32, 7 for float8). A tile that holds a value with its sign bit set is stored
            raw instead, so the result is exact for any input.
        backend: ``"torch"``, ``"triton"`` or None (Triton on CUDA when installed, else torch).
        geometry: the tile geometry (default: runs of 4096 elements).
        values: the buffer to append the value stream to, on ``x``'s device. By default a
            buffer of the worst-case size is allocated for this tensor alone.
        fixed: int32 words to hold the masks and tile words (``geometry.fixed_nbytes(numel) / 4``
            of them, for instance from an arena); allocated when omitted.
        nonzeros: an int64 ``[1]`` device counter the number of stored elements is added to.
        report: an int64 ``[1]`` tensor, zero, that receives the value stream's end plus one
            (the cursor after this tensor, so never zero) once the tensor is fully appended.
            On CUDA it may be pinned host memory, which a host can poll without a CUDA call.
        base: an int64 ``[1]`` device word that receives where the value stream starts (for
            instance an arena's ``next_start``); it must stay untouched while the result
            lives. Allocated when omitted.

    Returns:
        A ``CompressedTensor``. With a shared ``values`` buffer that ran out of space, its
        ``fits()`` is False and it must not be decompressed.

    Raises:
        TypeError: ``x`` is not a tensor, or its dtype is not supported.
        ValueError: ``x`` is sparse or too large, ``values`` is on another device, or the
            backend cannot run on ``x``'s device.
    """
    x = _check_tensor(x)
    spec = dtype_spec(x.dtype)
    geometry = geometry or TileGeometry()
    codec = get_codec(backend, x.device)
    numel = x.numel()
    if values is None:
        values = ValueBuffer(geometry.max_stream_words(numel, spec.bits), x.device)
    elif values.device != x.device:
        raise ValueError(f"values buffer is on {values.device} but the tensor is on {x.device}")
    if geometry.max_stream_words(numel, spec.bits) > MAX_TILE_OFFSET:
        raise ValueError("tensor too large for 31-bit tile offsets; split it")
    fixed_words = geometry.fixed_nbytes(numel) // 4
    if fixed is None:
        fixed = torch.empty(fixed_words, dtype=torch.int32, device=x.device)
    elif (
        fixed.dtype != torch.int32
        or fixed.shape != (fixed_words,)
        or fixed.device != x.device
        or not fixed.is_contiguous()
    ):
        raise ValueError(f"fixed must be {fixed_words} contiguous int32 words on {x.device}")
    _check_word("nonzeros", nonzeros, x.device)
    _check_word("report", report, x.device, host_too=True)
    _check_word("base", base, x.device)
    return compress_unchecked(x.contiguous(), codec, geometry, values, fixed, sign_pack, nonzeros, report, base)


def _check_word(name: str, t: torch.Tensor | None, device: torch.device, *, host_too: bool = False) -> None:
    """Raise unless ``t`` is None or an int64 ``[1]`` tensor on ``device`` (or, with
    ``host_too``, in host memory)."""
    devices = (device, torch.device("cpu")) if host_too else (device,)
    if t is not None and (t.dtype != torch.int64 or t.shape != (1,) or t.device not in devices):
        where = f"on {device} or in pinned host memory" if host_too else f"on {device}"
        raise ValueError(f"{name} must be an int64 tensor of shape (1,) {where}")


def compress_unchecked(
    x: torch.Tensor,
    codec: Codec,
    geometry: TileGeometry,
    values: ValueBuffer,
    fixed: torch.Tensor,
    sign_pack: bool,
    nonzeros: torch.Tensor | None = None,
    report: torch.Tensor | None = None,
    base: torch.Tensor | None = None,
) -> CompressedTensor:
    """``compress`` without its checks, for callers that built valid arguments themselves.

    ``x`` must be contiguous, of a supported dtype and at most ``MAX_NUMEL`` elements;
    ``codec`` one that runs on its device (``get_codec``); ``fixed`` exactly
    ``geometry.fixed_nbytes(x.numel()) / 4`` contiguous int32 words; every tensor on ``x``'s
    device (``report`` may be pinned host memory). ``base``, an int64 ``[1]`` word that
    receives where the value stream starts and must stay untouched while the result lives,
    is allocated when omitted. The arena's caller stores tensors this way: argument checks
    and allocations were a measurable share of the host time per tensor.
    """
    if base is None:
        base = torch.empty(1, dtype=torch.int64, device=x.device)
    if x.numel():
        spec = dtype_spec(x.dtype)
        stream, cursor, appends = values.words, values.cursor, values.appends
        codec.encode(x, fixed, stream, cursor, appends, base, spec, geometry, sign_pack, nonzeros, report)
    else:
        base.copy_(values.cursor)
        if report is not None:
            report.copy_(values.cursor + 1, non_blocking=True)
    return CompressedTensor(x.shape, x.dtype, sign_pack, geometry, fixed, values, base)


def decompress(c: CompressedTensor, *, backend: str | None = None) -> torch.Tensor:
    """Restore the tensor ``c`` was made from: same shape, dtype and device, equal bit for bit.

    The result is a new contiguous tensor. Never synchronizes with the host.

    Args:
        c: a ``CompressedTensor`` from ``compress``.
        backend: as for ``compress``; either backend reads what the other wrote.

    Raises:
        TypeError: ``c`` is not a ``CompressedTensor``.
        ValueError: the backend cannot run on ``c``'s device.
    """
    if not isinstance(c, CompressedTensor):
        raise TypeError(f"decompress expects a CompressedTensor, got {type(c).__name__}")
    return decompress_unchecked(c, get_codec(backend, c.device))


def decompress_unchecked(c: CompressedTensor, codec: Codec, *, with_square: bool = False):
    """``decompress`` with a codec the caller already chose (``get_codec``) for ``c``'s device.

    With ``with_square`` (float16, bfloat16 and float32 only), returns ``(x, square)``: the
    restored tensor and its elementwise square, made in the same pass and computed as
    ``torch.square`` computes it (float32 arithmetic rounded to nearest even). A caller that
    needs the square bit-identical to ``torch.square``'s checks it once per dtype and device:
    an implementation may round differently (Triton's interpreter truncates to bfloat16).
    """
    out = torch.empty(c.shape, dtype=c.dtype, device=c.fixed.device)
    square = torch.empty_like(out) if with_square else None
    codec.decode(c.fixed, c.values.words, c.base, out, dtype_spec(c.dtype), c.geometry, c.sign_pack, square)
    return (out, square) if with_square else out
