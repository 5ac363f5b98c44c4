"""The public codec API: ``compress``, ``decompress``, ``CompressedTensor`` and ``ValueBuffer``.

``compress_into`` and ``decompress_with`` are the same operations without argument checks,
for the arena and the hooks, which build valid arguments themselves.
"""

from __future__ import annotations

import dataclasses
import threading

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

    Thread safety: ``compress`` serializes appends to one buffer, and on CUDA orders them
    on the device too (an append on another stream than the last one waits for it there),
    so threads and streams may share a buffer. ``reset`` makes the buffer's earlier tensors
    undecodable: ``decompress`` refuses them.

    Args:
        capacity_words: usable words of the new buffer (an int >= 0).
        device: where the buffer lives.

    Raises:
        TypeError: ``capacity_words`` is not an int.
        ValueError: ``capacity_words`` is negative.
    """

    def __init__(self, capacity_words: int, device: torch.device | str | None = None):
        if isinstance(capacity_words, bool) or not isinstance(capacity_words, int):
            raise TypeError(f"capacity_words must be an int (a number of 32-bit words), got {capacity_words!r}")
        if capacity_words < 0:
            raise ValueError(f"capacity_words must be >= 0, got {capacity_words}")
        words = torch.empty(capacity_words + 1, dtype=torch.int32, device=device)
        self._init(words, torch.zeros(3, dtype=torch.int64, device=device))

    @classmethod
    def over(cls, words: torch.Tensor, counters: torch.Tensor) -> "ValueBuffer":
        """A buffer over existing ``words`` (the last is the guard) and ``counters`` (int64
        ``[3]``: the cursor, then the encoders' two scratch words, zero between appends).

        For allocators: an arena hands out such a view of its one allocation. Appends to
        buffers that share counters must be serialized by their owner.
        """
        if words.dtype != torch.int32 or words.dim() != 1 or words.numel() < 1:
            raise ValueError("words must be a non-empty 1-D int32 tensor")
        if counters.dtype != torch.int64 or counters.shape != (3,) or counters.device != words.device:
            raise ValueError("counters must be an int64 tensor of shape (3,) on the words' device")
        buffer = cls.__new__(cls)
        buffer._init(words, counters)
        return buffer

    def _init(self, words: torch.Tensor, counters: torch.Tensor) -> None:
        self.words = words
        self.cursor = counters[:1]
        self.appends = counters[1:]
        """The encoders' scratch: words an append has claimed so far, programs finished."""
        self.generation = 0
        """How many times ``reset`` was called; a compressed tensor remembers it."""
        self._counters = counters
        self._lock = threading.Lock()
        # The stream of the last append (at first, the one the memory was allocated on).
        self._last_stream = torch.cuda.current_stream(words.device) if words.device.type == "cuda" else None

    @property
    def capacity(self) -> int:
        """Usable words."""
        return self.words.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.words.device

    def reset(self) -> None:
        """Forget every stream written so far (asynchronously, in stream order): the space
        is reused, and the tensors compressed into it before can no longer be decompressed."""
        with self._lock:
            self._order_after_last_append()
            self.cursor.zero_()
            self.generation += 1

    def _order_after_last_append(self) -> None:
        """On CUDA, make the current stream wait for the last append made on another stream:
        encoders read and move the cursor in stream order. Call with the lock held."""
        if self._last_stream is None:
            return
        stream = torch.cuda.current_stream(self.words.device)
        if self._last_stream != stream:
            stream.wait_stream(self._last_stream)
            # The allocator must not reuse the memory before this stream is done with it.
            self.words.record_stream(stream)
            self._counters.record_stream(stream)
            self._last_stream = stream


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class CompressedTensor:
    """A tensor stored in the BitSparse format (``docs/format.md``). Read-only.

    Attributes:
        shape, dtype: those of the original tensor.
        sign_pack: whether sign packing was requested (tiles holding a value with its sign
            bit set are stored raw regardless).
        geometry: the tile geometry.
        fixed: int32 ``[num_tiles * (tile_size / 32 + 1)]``: the nonzero bitmasks, then the
            tile words (see ``masks`` and ``tile_words``).
        values: the buffer holding the value stream (possibly shared with other tensors).
        base: int64 ``[1]``, the word of ``values`` where this tensor's stream starts.
        generation: ``values.generation`` when the tensor was compressed.
    """

    shape: torch.Size
    dtype: torch.dtype
    sign_pack: bool
    geometry: TileGeometry
    fixed: torch.Tensor
    values: ValueBuffer
    base: torch.Tensor
    generation: int = 0
    _fit: list = dataclasses.field(default_factory=list, repr=False)
    """Empty until the fit is known, then ``[fits]`` (a private buffer always fits)."""

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
        """Whether every tile's values were written: false when the buffer ran out.

        Synchronizes the first time it is asked of a tensor in a shared buffer; the answer
        is kept.
        """
        if not self._fit:
            self._fit.append(bool(self.base + self.stream_words() <= self.values.capacity))
        return self._fit[0]


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
        values: a ``ValueBuffer`` on ``x``'s device to append the value stream to, shared by
            many tensors to save memory. By default a private buffer of the worst-case size
            (about dense) is allocated for this tensor alone.

    Returns:
        A ``CompressedTensor``. If a shared ``values`` buffer ran out of space, its
        ``fits()`` is False and ``decompress`` refuses it.

    Raises:
        TypeError: ``x`` is not a tensor, its dtype is not supported, or ``values`` is not a
            ``ValueBuffer``.
        ValueError: ``x`` is sparse or too large, ``values`` is on another device, or the
            backend cannot run on ``x``'s device.
    """
    x = _check_tensor(x)
    spec = dtype_spec(x.dtype)
    geometry = geometry or TileGeometry()
    codec = get_codec(backend, x.device)
    numel = x.numel()
    if geometry.max_stream_words(numel, spec.bits) > MAX_TILE_OFFSET:
        raise ValueError("tensor too large for 31-bit tile offsets; split it")
    fixed = torch.empty(geometry.fixed_nbytes(numel) // 4, dtype=torch.int32, device=x.device)
    if values is None:
        values = ValueBuffer(geometry.max_stream_words(numel, spec.bits), x.device)
        c = compress_into(x.contiguous(), codec, geometry, values, fixed, sign_pack)
        c._fit.append(True)
        return c
    if not isinstance(values, ValueBuffer):
        raise TypeError(f"values must be a bitsparse.ValueBuffer, got {type(values).__name__}")
    if values.device != x.device:
        raise ValueError(f"values buffer is on {values.device} but the tensor is on {x.device}")
    with values._lock:
        values._order_after_last_append()
        return compress_into(x.contiguous(), codec, geometry, values, fixed, sign_pack)


def compress_into(
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
    """``compress`` for allocators, without its checks and with the append's protocol.

    ``x`` must be contiguous, of a supported dtype and at most ``MAX_NUMEL`` elements;
    ``codec`` one that runs on its device (``get_codec``); ``fixed`` exactly
    ``geometry.fixed_nbytes(x.numel()) / 4`` contiguous int32 words; every tensor on ``x``'s
    device (``report`` may be pinned host memory). The caller serializes appends to
    ``values`` and keeps them in one stream order.

    Args:
        nonzeros: an int64 ``[1]`` device counter the number of stored elements is added to.
        report: an int64 ``[1]`` tensor, zero, that receives the value stream's end plus one
            (the cursor after this tensor, so never zero) once the tensor is fully appended;
            on CUDA it may be pinned host memory, which a host can poll without a CUDA call.
        base: an int64 ``[1]`` device word that receives where the value stream starts; it
            must stay untouched while the result lives. Allocated when omitted.
    """
    if base is None:
        base = torch.empty(1, dtype=torch.int64, device=x.device)
    if x.numel():
        stream, cursor, appends = values.words, values.cursor, values.appends
        spec = dtype_spec(x.dtype)
        codec.encode(x, fixed, stream, cursor, appends, base, spec, geometry, sign_pack, nonzeros, report)
    else:
        base.copy_(values.cursor)
        if report is not None:
            report.copy_(values.cursor + 1, non_blocking=True)
    return CompressedTensor(x.shape, x.dtype, sign_pack, geometry, fixed, values, base, values.generation)


def decompress(c: CompressedTensor, *, backend: str | None = None) -> torch.Tensor:
    """Restore the tensor ``c`` was made from: same shape, dtype and device, equal bit for bit.

    The result is a new contiguous tensor. It does not synchronize with the host, except
    the first time a tensor of a shared ``ValueBuffer`` is decompressed (or asked ``fits()``):
    that reads from the device whether its values fit.

    Args:
        c: a ``CompressedTensor`` from ``compress``.
        backend: as for ``compress``; either backend reads what the other wrote.

    Raises:
        TypeError: ``c`` is not a ``CompressedTensor``.
        ValueError: the backend cannot run on ``c``'s device; ``c`` is inconsistent (its
            fixed part does not match its shape); its values did not fit their buffer; or
            the buffer was reset after ``c`` was made.
    """
    if not isinstance(c, CompressedTensor):
        raise TypeError(f"decompress expects a CompressedTensor, got {type(c).__name__}")
    codec = get_codec(backend, c.device)
    dtype_spec(c.dtype)
    fixed_words = c.geometry.fixed_nbytes(c.numel) // 4
    if c.fixed.dtype != torch.int32 or c.fixed.shape != (fixed_words,) or c.values.device != c.device:
        raise ValueError(
            f"this CompressedTensor is inconsistent: a {tuple(c.shape)} tensor has {fixed_words} int32 words "
            f"of masks and tile words on its values' device, it holds {tuple(c.fixed.shape)} {c.fixed.dtype} "
            f"on {c.device}; decompress only what compress returned"
        )
    if c.generation != c.values.generation:
        raise ValueError(
            "the ValueBuffer this tensor was compressed into was reset since, so its values may have been "
            "overwritten; compress it again after the reset"
        )
    if not c.fits():
        raise ValueError(
            f"this tensor's values did not fit its ValueBuffer ({c.values.capacity} words; the buffer's cursor "
            f"is at {int(c.values.cursor)}), so they were not stored; compress it into a larger buffer"
        )
    return decompress_with(c, codec)


def decompress_with(c: CompressedTensor, codec: Codec, *, square: bool = False):
    """``decompress`` with a codec the caller chose (``get_codec``) for ``c``'s device, and
    without its checks: the caller knows that ``c`` fits.

    With ``square`` (float16, bfloat16 and float32 only), returns ``(x, x_squared)``: the
    restored tensor and its elementwise square, written in the same pass. The square is
    computed in float32 and rounded to nearest even; whether that is bit-identical to a
    given PyTorch op is the caller's to check (NaN payloads, for instance, depend on the op
    and the device).
    """
    out = torch.empty(c.shape, dtype=c.dtype, device=c.fixed.device)
    x_squared = torch.empty_like(out) if square else None
    codec.decode(c.fixed, c.values.words, c.base, out, dtype_spec(c.dtype), c.geometry, c.sign_pack, x_squared)
    return (out, x_squared) if square else out
