"""The Triton codec: one pass over the data in each direction, no host synchronization.

Encoding works on one tile of 4096 elements as a 1-D block: it builds the 32-bit mask words
from the nonzero test, ranks every element among the tile's nonzeros (exclusive scan of the
words' popcounts, gathered back to the elements, plus the popcount of the bits below each),
claims the tile's stream words with one relaxed atomic add on a per-append counter (relative
to the cursor, which every program reads first), and scatters the values to ``start + rank``.
The last program to finish, counted with a second atomic, advances the cursor, clears the
counters and writes the report: an append is one launch, with nothing else on the stream.
Without sign packing there is one program per tile. With it the grid is persistent,
because each program needs a scratch block (it stays in L2): a packed tile's values are
compacted there first, then each output word is assembled from the at most
``floor(31 / b) + 2`` values that overlap it, so every word is written once, whole.

On CUDA (compute capability 8.0 and up), with the default tile size and an aligned stream,
``gluon_kernels`` encodes, and decodes 8- and 16-bit values and streams that may hold packed
tiles: its kernels stage a tile's values in shared memory and move the stream in wide
accesses (1.2x to 6x faster, docs/benchmarks.md). The kernels here are the portable ones,
and the ones the CPU tests run under the interpreter.

Decoding runs one program per tile (per quarter tile when tiles may be packed): the same
rank computation, then a gather (raw values) or a two-word funnel shift (packed values) for
every set bit, and a dense store of the tile (and, when asked, of its square, or of its
square and the gradient of a ReLU's input in its place).

Measuring (``measure``) counts each tile's stored values, as the encoder does, and claims the
words they would take, eight tiles to a program with one atomic per program; it ends the append as
the encoder does (the cursor moves, the report is written) and writes nothing else.
``measure_tiles`` stores each tile's words instead, with plain stores: no counters, no atomics.

The kernels are launched through their compiled form (``_Launcher``), which skips most of
the host time of a Triton launch.

Both rely on Triton internals that change between releases. The Gluon kernels run only on
the Triton release they were verified with (``GLUON_TRITON``); on CUDA with another one the
portable kernels serve every call, and the first use says so once (``SlowKernelsWarning``).
The direct launch is used on the releases whose launcher was checked (``FAST_LAUNCH_TRITON``),
Triton's own launch on others; it goes through PyTorch's static launcher on the PyTorch
releases whose launcher was read (``STATIC_LAUNCH_TORCH``), through the compiled kernel's own
launcher on others.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors; the interpreter has no popcount
instruction, so a SWAR popcount is compiled in instead of ``libdevice.popc``.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Callable

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from bitsparse.codecs.appends import finish_append
from bitsparse.format import WORD_BITS

try:
    from triton import knobs
except ImportError:  # a Triton without knobs: Triton's own launch only
    knobs = None

name = "triton"

ENCODE_PROGRAMS_PER_SM = 8
ENCODE_NUM_WARPS = 4
DECODE_NUM_WARPS = 2
DECODE_PARTS = {False: 1, True: 4}
"""Programs per tile, by whether tiles may be sign-packed (measured: docs/benchmarks.md)."""
INTERPRETER_PROGRAMS = 3  # enough to exercise the persistent loop under the interpreter

# Arguments Triton must not specialize on (integer values, pointer alignment): the compiled
# kernel then depends only on what ``_Launcher``'s key holds. Kept: the alignment of the
# dense tensors, the stream and the fixed part, and Triton's classes of the element count and
# of the tiles per program (vectorized loads and stores; a loop known to run once).
_ENCODE_UNSPECIALIZED = [
    "cursor_ptr", "appends_ptr", "base_ptr", "report_ptr", "nonzeros_ptr", "scratch_ptr",
    "capacity", "num_tiles", "num_programs",
]  # fmt: skip
_DECODE_UNSPECIALIZED = ["base_ptr", "num_tiles"]

MEASURE_TILES_PER_PROGRAM = 8
"""Tiles a measuring program counts before it adds their words to the claim, in one atomic."""
_MEASURE_UNSPECIALIZED = ["cursor_ptr", "appends_ptr", "report_ptr", "tile_words_ptr", "num_programs"]


@triton.jit
def _popcount(x, HW_POPC: tl.constexpr):
    """Set bits of each uint32 element, as int32."""
    if HW_POPC:
        return libdevice.popc(x.to(tl.int32, bitcast=True))
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _mask_words(nonzero, MASK_WORDS: tl.constexpr):
    """Pack ``[32 * MASK_WORDS]`` booleans into uint32 words, element ``32 w + i`` at bit i of word w."""
    bits = tl.reshape(nonzero.to(tl.uint32), [MASK_WORDS, 32])
    return tl.sum(bits << tl.arange(0, 32)[None, :].to(tl.uint32), axis=1)


@triton.jit
def _tile_ranks(words, offsets, HW_POPC: tl.constexpr):
    """Each position's rank among the tile's nonzeros, from the tile's mask words (uint32).

    Returns ``(rank, word, count)``: the rank and the mask word of each position in
    ``offsets`` (``0 .. tile_size - 1``), and the tile's number of nonzeros. The rank is the
    exclusive scan of the words' popcounts plus the popcount of the word's bits below the
    position: only ``tile_size / 32`` values are scanned.
    """
    counts = _popcount(words, HW_POPC)
    word_starts = tl.cumsum(counts, axis=0) - counts
    word = tl.gather(words, offsets // 32, 0)
    below = (tl.full(offsets.shape, 1, tl.uint32) << (offsets % 32).to(tl.uint32)) - 1
    rank = tl.gather(word_starts, offsets // 32, 0) + _popcount(word & below, HW_POPC)
    return rank, word, tl.sum(counts, axis=0)


@triton.jit
def _flag(condition):
    """A scalar comparison as a boolean to combine with block masks.

    The compiler folds this select of constants away (the PTX is unchanged). The interpreter
    needs it: it types a comparison's result like its operands, so a scalar comparison
    broadcast into a mask became an integer mask, which Triton 3.9's interpreter rejects
    ("mask has unsupported dtype"); the select's result is typed like its constants.
    """
    return tl.where(condition, True, False)


@triton.jit
def _as_bits(x, BITS: tl.constexpr):
    """The bit patterns of ``x`` (a float or integer block of width ``BITS``) as signed integers."""
    if BITS == 8:
        return x.to(tl.int8, bitcast=True)
    elif BITS == 16:
        return x.to(tl.int16, bitcast=True)
    else:
        return x.to(tl.int32, bitcast=True)


@triton.jit
def _bits_pointer(ptr, BITS: tl.constexpr):
    """``ptr`` as a pointer to signed integers of width ``BITS`` (raw values in the stream)."""
    if BITS == 8:
        return ptr.to(tl.pointer_type(tl.int8))
    elif BITS == 16:
        return ptr.to(tl.pointer_type(tl.int16))
    else:
        return ptr.to(tl.pointer_type(tl.int32))


@triton.jit
def _load_bits(x_ptr, square_ptr, index, mask, BITS: tl.constexpr, RELU_SQUARE: tl.constexpr):
    """The bit patterns of ``x`` at ``index`` (0 where masked off). With ``RELU_SQUARE``,
    those of ``relu(x)`` (``+0.0`` below zero, every other value's bits kept), whose square
    is stored at ``index`` of ``square_ptr``: in float32, rounded to nearest even, as
    inductor computes ``relu(x) ** 2``."""
    x = tl.load(x_ptr + index, mask=mask, other=0)
    bits = _as_bits(x, BITS)
    if RELU_SQUARE:
        wide = x.to(tl.float32)
        below = wide < 0
        square = tl.where(below, 0.0, wide * wide)
        tl.store(square_ptr + index, square.to(square_ptr.dtype.element_ty), mask=mask)
        bits = tl.where(below, tl.zeros_like(bits), bits)
    return bits


@triton.jit(do_not_specialize=_ENCODE_UNSPECIALIZED, do_not_specialize_on_alignment=_ENCODE_UNSPECIALIZED)
def _encode_kernel(
    x_ptr,
    stream_ptr,
    fixed_ptr,
    cursor_ptr,
    appends_ptr,
    base_ptr,
    report_ptr,
    nonzeros_ptr,
    scratch_ptr,
    square_ptr,
    numel,
    capacity,
    num_tiles,
    num_programs,
    tiles_per_program,
    TILE: tl.constexpr,
    BITS: tl.constexpr,
    SIGN_PACK: tl.constexpr,
    PACKED_WORDS_BLOCK: tl.constexpr,
    COUNT_NONZEROS: tl.constexpr,
    REPORT: tl.constexpr,
    HW_POPC: tl.constexpr,
    RELU_SQUARE: tl.constexpr,
):
    MASK_WORDS: tl.constexpr = TILE // 32
    VALUES_PER_WORD: tl.constexpr = 32 // BITS
    PACKED_BITS: tl.constexpr = BITS - 1
    OVERLAPPING_VALUES: tl.constexpr = 31 // PACKED_BITS + 2
    pid = tl.program_id(0)
    offsets = tl.arange(0, TILE)
    tile_words_ptr = fixed_ptr + num_tiles * MASK_WORDS
    # The cursor moves only when every program has finished (below), so all read the same.
    base = tl.load(cursor_ptr)
    if pid == 0:
        tl.store(base_ptr, base)
    for step in range(tiles_per_program):
        # Past the last tile everything below is masked off (and the atomic adds zero).
        tile = pid + step * num_programs
        real = _flag(tile < num_tiles)
        index = tile * TILE + offsets
        inside = real & (index < numel)
        x = _load_bits(x_ptr, square_ptr, index, inside, BITS, RELU_SQUARE)
        nonzero = x != 0
        words = _mask_words(nonzero, MASK_WORDS)
        tl.store(
            fixed_ptr + tile * MASK_WORDS + tl.arange(0, MASK_WORDS),
            words.to(tl.int32, bitcast=True),
            mask=real,
        )
        rank, _, count = _tile_ranks(words, offsets, HW_POPC)
        if COUNT_NONZEROS:
            tl.atomic_add(nonzeros_ptr, count.to(tl.int64), sem="relaxed")
        if SIGN_PACK:
            packed = _flag(tl.max(tl.where(nonzero & (x < 0), 1, 0)) == 0)
        else:
            packed = False
        width = tl.where(packed, PACKED_BITS, BITS)
        length = (count * width + 31) // 32
        offset = tl.atomic_add(appends_ptr, length.to(tl.int64), sem="relaxed")
        start = base + offset
        tl.store(tile_words_ptr + tile, offset.to(tl.int32) | (packed.to(tl.int32) << 31), mask=real)
        fits = _flag(start + length <= capacity)
        raw_values = _bits_pointer(stream_ptr, BITS) + start * VALUES_PER_WORD
        tl.store(raw_values + rank, x, mask=nonzero & fits & (not packed))
        # Zero the unused slots of the tile's last word, so the stream's bytes are defined.
        padding = count + tl.arange(0, VALUES_PER_WORD)
        tl.store(raw_values + padding, 0, mask=(padding < length * VALUES_PER_WORD) & fits & (not packed))
        if SIGN_PACK:
            # Compact the values in scratch (it stays in L2), then build each word whole.
            scratch = scratch_ptr + pid * TILE
            tl.store(scratch + rank, x, mask=nonzero & packed)
            tl.debug_barrier()
            j = tl.arange(0, PACKED_WORDS_BLOCK)
            first = (j * 32) // PACKED_BITS
            word = tl.zeros([PACKED_WORDS_BLOCK], dtype=tl.uint32)
            for i in tl.static_range(OVERLAPPING_VALUES):
                k = first + i
                v = tl.load(scratch + k, mask=(k < count) & (j < length) & packed, other=0)
                v = (v.to(tl.int32) & ((1 << PACKED_BITS) - 1)).to(tl.uint32)
                shift = k * PACKED_BITS - j * 32
                left = v << tl.minimum(tl.maximum(shift, 0), 31).to(tl.uint32)
                right = v >> tl.minimum(tl.maximum(-shift, 0), 31).to(tl.uint32)
                word |= tl.where(shift >= 32, 0, tl.where(shift >= 0, left, right))
            tl.store(
                stream_ptr + start + j,
                word.to(tl.int32, bitcast=True),
                mask=(j < length) & packed & fits,
            )
            tl.debug_barrier()
    finish_append(appends_ptr, cursor_ptr, report_ptr, base, num_programs, REPORT)


@triton.jit(do_not_specialize=_DECODE_UNSPECIALIZED, do_not_specialize_on_alignment=_DECODE_UNSPECIALIZED)
def _decode_kernel(
    out_ptr,
    square_ptr,
    square_grad_ptr,
    stream_ptr,
    fixed_ptr,
    base_ptr,
    numel,
    num_tiles,
    TILE: tl.constexpr,
    BITS: tl.constexpr,
    MAY_BE_PACKED: tl.constexpr,
    HW_POPC: tl.constexpr,
    PARTS: tl.constexpr,
    SQUARE: tl.constexpr,
    SQUARE_GRAD: tl.constexpr,
):
    MASK_WORDS: tl.constexpr = TILE // 32
    VALUES_PER_WORD: tl.constexpr = 32 // BITS
    PACKED_BITS: tl.constexpr = BITS - 1
    PART: tl.constexpr = TILE // PARTS
    # Each program restores one part of a tile: more, smaller programs hide more latency.
    tile = tl.program_id(0) // PARTS
    offsets = (tl.program_id(0) % PARTS) * PART + tl.arange(0, PART)
    words = tl.load(fixed_ptr + tile * MASK_WORDS + tl.arange(0, MASK_WORDS))
    rank, word, _ = _tile_ranks(words.to(tl.uint32, bitcast=True), offsets, HW_POPC)
    nonzero = ((word >> (offsets % 32).to(tl.uint32)) & 1) != 0
    tile_word = tl.load(fixed_ptr + num_tiles * MASK_WORDS + tile)
    packed = _flag(tile_word < 0)
    start = tl.load(base_ptr) + (tile_word & 0x7FFFFFFF)
    x = tl.load(_bits_pointer(stream_ptr, BITS) + start * VALUES_PER_WORD + rank, mask=nonzero & (not packed), other=0)
    if MAY_BE_PACKED:
        bit = rank * PACKED_BITS
        word = start + (bit >> 5)
        shift = (bit & 31).to(tl.uint32)
        spills = shift + PACKED_BITS > 32
        low = tl.load(stream_ptr + word, mask=nonzero & packed, other=0)
        high = tl.load(stream_ptr + word + 1, mask=nonzero & packed & spills, other=0)
        low = low.to(tl.uint32, bitcast=True) >> shift
        high = high.to(tl.uint32, bitcast=True) << ((32 - shift) & 31)
        value = (low | high) & ((1 << PACKED_BITS) - 1)
        x = tl.where(packed, value.to(x.dtype), x)
    index = tile * TILE + offsets
    inside = index < numel
    value = x.to(out_ptr.dtype.element_ty, bitcast=True)
    if SQUARE:
        # As PyTorch squares: in float32, rounded to nearest even.
        wide = value.to(tl.float32)
        tl.store(square_ptr + index, (wide * wide).to(out_ptr.dtype.element_ty), mask=inside)
        if SQUARE_GRAD:
            square_grad = tl.load(square_grad_ptr + index, mask=inside)
            value = _relu_square_grad(wide, square_grad, out_ptr.dtype.element_ty)
    tl.store(out_ptr + index, value, mask=inside)


@triton.jit
def _relu_square_grad(wide, square_grad, dtype: tl.constexpr):
    """The gradient of a ReLU's input, given its output ``wide`` (in float32) and the gradient
    of that output's square, as compiled code computes it (the codecs' ``relu_square_backward``)."""
    return tl.where(wide <= 0.0, 0.0, square_grad.to(tl.float32) * (wide * 2.0)).to(dtype)


@triton.jit
def _relu_square_backward_kernel(
    r_ptr, square_grad_ptr, square_ptr, grad_input_ptr, numel, BLOCK: tl.constexpr, RELU_INPUT: tl.constexpr
):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < numel
    wide = tl.load(r_ptr + index, mask=inside).to(tl.float32)
    if RELU_INPUT:  # the bits of every element not below zero, -0.0 and NaNs included
        wide = tl.where(wide < 0.0, 0.0, wide)
    dtype = square_ptr.dtype.element_ty
    tl.store(square_ptr + index, (wide * wide).to(dtype), mask=inside)
    square_grad = tl.load(square_grad_ptr + index, mask=inside)
    tl.store(grad_input_ptr + index, _relu_square_grad(wide, square_grad, dtype), mask=inside)


def relu_square_backward(r, square_grad, square, grad_input, relu_input=False):
    # For tensors kept dense, seldom: Triton's own launch.
    numel = r.numel()
    if numel:
        grid = (triton.cdiv(numel, RELU_SQUARE_BACKWARD_BLOCK),)
        _relu_square_backward_kernel[grid](
            r, square_grad, square, grad_input, numel, RELU_SQUARE_BACKWARD_BLOCK, relu_input
        )


RELU_SQUARE_BACKWARD_BLOCK = 1024


@triton.jit(do_not_specialize=_MEASURE_UNSPECIALIZED, do_not_specialize_on_alignment=_MEASURE_UNSPECIALIZED)
def _measure_kernel(
    x_ptr,
    cursor_ptr,
    appends_ptr,
    report_ptr,
    square_ptr,
    tile_words_ptr,
    numel,
    num_programs,
    TILE: tl.constexpr,
    BITS: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    SIGN_PACK: tl.constexpr,
    REPORT: tl.constexpr,
    RELU_SQUARE: tl.constexpr,
    PER_TILE: tl.constexpr,
):
    """Count the words ``_encode_kernel`` would append for ``TILES_PER_PROGRAM`` tiles: with
    ``PER_TILE``, store each tile's at ``tile_words_ptr``; else claim them and end the append
    as the encoder does (the cursor moves). Nothing else is written but the square of
    ``RELU_SQUARE``."""
    offsets = tl.arange(0, TILE)
    if not PER_TILE:
        base = tl.load(cursor_ptr)
    words = tl.zeros([], dtype=tl.int32)
    for i in tl.static_range(TILES_PER_PROGRAM):
        tile = tl.program_id(0) * TILES_PER_PROGRAM + i
        index = tile * TILE + offsets
        x = _load_bits(x_ptr, square_ptr, index, index < numel, BITS, RELU_SQUARE)
        nonzero = x != 0
        count = tl.sum(nonzero.to(tl.int32), axis=0)
        if SIGN_PACK:
            width = tl.where(tl.max(tl.where(nonzero & (x < 0), 1, 0)) == 0, BITS - 1, BITS)
        else:
            width = BITS
        if PER_TILE:
            tl.store(tile_words_ptr + tile, (count * width + 31) // 32, mask=tile * TILE < numel)
        else:
            words += (count * width + 31) // 32
    if not PER_TILE:
        tl.atomic_add(appends_ptr, words.to(tl.int64), sem="relaxed")
        finish_append(appends_ptr, cursor_ptr, report_ptr, base, num_programs, REPORT)


INTERPRETED = isinstance(_decode_kernel, InterpretedFunction)


class _Launcher:
    """Launches a jitted kernel through the compiled kernel Triton chose for the same key.

    ``JITFunction.run`` binds and specializes every argument on every call, which was most
    of a launch's host time (docs/benchmarks.md). The kernels here leave most arguments
    unspecialized, so a key of the rest (dtypes, the alignment of a few pointers, the
    element count's divisibility), the constexprs and the launch options determines the
    compiled kernel: the first launch with a key goes through Triton and keeps what it
    compiled, later ones call it directly. A GPU test checks that Triton agrees.

    ``options`` are the kernel's launch options (``num_warps``, ``maxnreg``), fixed per kernel.
    """

    def __init__(self, kernel, **options):
        self._kernel = kernel
        self.options = options
        self._compiled: dict[tuple, object] = {}
        """The kernel Triton compiled for each device and key."""
        self._direct: dict[tuple, Callable[[int, int, tuple], None]] = {}
        """Its direct launch (``_direct_launch``)."""

    def __call__(self, grid: int, device: int, key: tuple, args: tuple) -> None:
        """Launch ``grid`` programs on CUDA device ``device`` with ``args`` (every parameter,
        constexprs included, in order, pointers as tensors); ``key`` must determine Triton's
        specialization."""
        if INTERPRETED:
            self._kernel[(grid,)](*args, **self.options)
            return
        if device != torch.cuda.current_device():
            with torch.cuda.device(device):
                self(grid, device, key, args)
            return
        direct = self.ready(device, key)
        if direct is None:
            # Triton's own path: compiles on first use, and runs any launch hooks (profilers).
            # Where the direct launch below is not known to work, nothing is kept and every
            # launch takes this path.
            compiled = self._kernel[(grid,)](*args, **self.options)
            if _FAST_LAUNCH and _launchable(compiled):
                self._compiled[(device,) + key] = compiled
                self._direct[(device,) + key] = _direct_launch(compiled)
            return
        self.launch(direct, grid, device, args)

    def ready(self, device: int, key: tuple):
        """The direct launch of the kernel compiled for ``key`` on ``device``, the current
        device, to pass to ``launch``; None when the launch must go through ``__call__`` (the
        first with this key, a profiler's launch hooks installed, or the interpreter)."""
        if INTERPRETED or _launch_hooks_set() or torch._C._cuda_getDevice() != device:
            return None
        return self._direct.get((device,) + key)

    @staticmethod
    def launch(direct, grid: int, device: int, args: tuple) -> None:
        """Launch ``direct`` (from ``ready``) on the current stream. Pointers in ``args`` may
        be addresses (ints): the launcher then neither calls ``data_ptr`` nor asks the driver
        what the pointer is, which was most of a launch's host time."""
        direct(grid, torch._C._cuda_getCurrentRawStream(device), args)


def _launch_hooks_set() -> bool:
    """Whether a launch hook (a profiler's) is installed: a ``HookChain`` with calls since
    Triton 3.5, a callable or None before."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _launchable(compiled) -> bool:
    """Whether ``compiled`` (what a launch through Triton returned) has what the direct launch calls."""
    return all(hasattr(compiled, attribute) for attribute in ("run", "function", "packed_metadata"))


def _direct_launch(compiled) -> Callable[[int, int, tuple], None]:
    """``launch(grid, stream, args)`` for ``compiled``, ``args`` as ``_Launcher`` takes them.

    Through PyTorch's launcher of Triton kernels (``torch._C._StaticCudaLauncher``, which
    inductor's generated code uses) where the kernel is one it launches as Triton would:
    given each argument's type once, it launches with about 2 us less host time than the
    compiled kernel's own launcher (docs/benchmarks.md); through the compiled kernel's own
    launcher otherwise.
    """
    arg_types = _static_arg_types(compiled)
    if arg_types is None:
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata

        def launch(grid: int, stream: int, args: tuple) -> None:
            run(grid, 1, 1, stream, function, metadata, None, None, None, *args)

        return launch
    launch_kernel, function = _STATIC_LAUNCHER._launch_kernel, compiled.function
    warps, shared = compiled.metadata.num_warps, compiled.metadata.shared
    count, scratch = len(arg_types) - _SCRATCH_POINTERS, (None,) * _SCRATCH_POINTERS

    def launch(grid: int, stream: int, args: tuple) -> None:
        # The constexprs come last, and the kernel takes none of them.
        launch_kernel(function, grid, 1, 1, warps, shared, arg_types, args[:count] + scratch, stream)

    return launch


_SCRATCH_POINTERS = 2
"""The pointers a compiled kernel takes after its own arguments (Triton's global and profile
scratch), None where it needs no scratch memory."""
_STATIC_TYPES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H"}
_STATIC_TYPES.update({"u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "fp64": "d"})
"""The static launcher's code for each scalar type of a Triton signature (pointers: "O")."""


def _static_arg_types(compiled) -> str | None:
    """The static launcher's argument types for ``compiled`` (its arguments, then the scratch
    pointers), or None where it does not launch the kernel as Triton would: a kernel that
    needs scratch memory, clusters, a cooperative grid, programmatic dependent launch or
    tensor descriptors, a constexpr before a runtime argument, an unknown type, ROCm, a
    compiled kernel that does not say all of this (another Triton's), or a PyTorch without
    the launcher or whose launcher was not read (``STATIC_LAUNCH_TORCH``)."""
    metadata = getattr(compiled, "metadata", None)
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if _STATIC_LAUNCHER is None or torch.version.hip is not None or not isinstance(signature, dict):
        return None
    if not all(isinstance(getattr(metadata, attribute, None), int) for attribute in ("num_warps", "shared")):
        return None
    for attribute in ("global_scratch_size", "profile_scratch_size"):
        if getattr(metadata, attribute, None) != 0:
            return None
    unsupported = ("launch_cooperative_grid", "launch_pdl", "tensordesc_meta")
    if getattr(metadata, "num_ctas", 1) != 1 or any(getattr(metadata, a, None) for a in unsupported):
        return None
    types = list(signature.values())
    if not all(isinstance(t, str) for t in types):
        return None
    runtime = [t for t in types if t != "constexpr"]
    if types[: len(runtime)] != runtime:
        return None
    codes = ["O" if t.startswith("*") else _STATIC_TYPES.get(t) for t in runtime]
    if None in codes:
        return None
    return "".join(codes) + "O" * _SCRATCH_POINTERS


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string ("3.6.0", "3.7.0+git1a2b3c", "2.11.0+cu130");
    (0, 0) if it has none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


_TRITON = release(triton.__version__)
FAST_LAUNCH_TRITON = ((3, 6), (3, 9))
"""The Triton releases (first and last) whose launch ``_Launcher`` calls directly was read in
their sources: ``CompiledKernel.run(grid_x, grid_y, grid_z, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``, hooks None allowed."""
_FAST_LAUNCH = (
    knobs is not None
    and hasattr(knobs, "runtime")
    and hasattr(knobs.runtime, "launch_enter_hook")
    and FAST_LAUNCH_TRITON[0] <= _TRITON <= FAST_LAUNCH_TRITON[1]
)

STATIC_LAUNCH_TORCH = ((2, 11), (2, 14))
"""The PyTorch releases (first and last) whose static launcher ``_direct_launch`` calls was read
in their sources: ``_launch_kernel(function, grid_x, grid_y, grid_z, num_warps, shared,
arg_types, args, stream)``, pointers given as integers, and inductor's caller of it with the
same argument types and scratch pointers as ``_static_arg_types``; other releases launch
through the compiled kernel's launcher."""
_STATIC_LAUNCHER = (
    getattr(torch._C, "_StaticCudaLauncher", None)
    if STATIC_LAUNCH_TORCH[0] <= release(torch.__version__) <= STATIC_LAUNCH_TORCH[1]
    else None
)

_encode_launcher = _Launcher(_encode_kernel, num_warps=ENCODE_NUM_WARPS)
_decode_launcher = _Launcher(_decode_kernel, num_warps=DECODE_NUM_WARPS)
_measure_launcher = _Launcher(_measure_kernel, num_warps=ENCODE_NUM_WARPS)

# Faster kernels for some cases on NVIDIA GPUs (their module says why they are Gluon and
# PTX). Gluon's API is experimental: they run on the Triton they were written and tested for.
GLUON_TRITON = (3, 6)
"""The Triton release (major, minor) the Gluon kernels were written and verified for."""


class SlowKernelsWarning(UserWarning):
    """The fast (Gluon) CUDA kernels are not verified for the installed Triton: the portable
    Triton kernels encode and decode instead, correctly but more slowly."""


def gluon_decision(version: str, interpreted: bool, hip: str | None) -> tuple[bool, str | None]:
    """Whether the Gluon kernels may run with Triton ``version``, and when they may not for a
    reason the user can fix, the warning that says so (None otherwise).

    Under the interpreter (the CPU) and on ROCm (``hip``, a HIP version) they never run, by
    design, and nothing is said. On CUDA they run on the verified release only.
    """
    if interpreted or hip is not None:
        return False, None
    if release(version) == GLUON_TRITON:
        return True, None
    verified = ".".join(map(str, GLUON_TRITON))
    return False, (
        f"bitsparse: its fast CUDA kernels (Gluon) are verified with triton {verified} only, and triton "
        f"{version} is installed, so the portable Triton kernels encode and decode instead: the results "
        f"are the same, but encoding and decoding are slower (1.2x to 6x, docs/benchmarks.md). For the "
        f"fast kernels, install triton {verified} (the release torch 2.11 requires)."
    )


_GLUON, _GLUON_WARNING = gluon_decision(triton.__version__, INTERPRETED, torch.version.hip)
gluon_kernels = None
if _GLUON:
    try:
        from bitsparse.codecs import gluon_kernels
    except Exception as error:  # a Triton built without Gluon, or one whose Gluon changed
        _GLUON = False
        _GLUON_WARNING = (
            f"bitsparse: its fast CUDA kernels (Gluon) could not be loaded with triton {triton.__version__} "
            f"({error!r}), so the portable Triton kernels encode and decode instead: the results are the "
            "same, but encoding and decoding are slower (1.2x to 6x, docs/benchmarks.md)."
        )
_warned = False


def _warn_if_slow() -> None:
    """Say once per process, at the first use on CUDA, that the Gluon kernels do not run."""
    global _warned
    if _GLUON_WARNING is not None and not _warned:
        _warned = True
        warnings.warn(_GLUON_WARNING, SlowKernelsWarning, stacklevel=4)


def _per_value_width(kernel, options_by_width: dict) -> dict[int, _Launcher]:
    """A launcher of ``kernel`` for each value width, with that width's launch options."""
    return {bits: _Launcher(kernel, **options) for bits, options in options_by_width.items()}


_gluon_encode_launchers = _per_value_width(gluon_kernels.encode_kernel, gluon_kernels.ENCODE_OPTIONS) if _GLUON else {}
_gluon_decode_launchers = _per_value_width(gluon_kernels.decode_kernel, gluon_kernels.DECODE_OPTIONS) if _GLUON else {}


def _gluon_serves(tile: int, spec, stream: torch.Tensor) -> bool:
    """Whether the Gluon kernels can take this call: they are built for the default tile and
    for GPUs with asynchronous copies, and move the stream in 16-byte vectors (an arena's
    stream is aligned)."""
    return (
        _GLUON
        and gluon_kernels.supports(tile, spec.itemsize)
        and _aligned(stream)
        and _has_async_copies(stream.get_device())
    )


@functools.lru_cache(maxsize=None)
def _has_async_copies(device: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def check_device(device: torch.device) -> None:
    if device.type == "cuda" and not INTERPRETED:
        _warn_if_slow()
        return
    if device.type == "cuda" or (device.type == "cpu" and INTERPRETED):
        return
    raise ValueError(
        f"the triton backend runs on CUDA tensors, got a tensor on {device}; use backend='torch', "
        "or set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU"
    )


@functools.lru_cache(maxsize=None)
def _encode_programs(device: int) -> int:
    if INTERPRETED:
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count * ENCODE_PROGRAMS_PER_SM


@functools.lru_cache(maxsize=None)
def _packed_words_block(tile: int, packed_bits: int) -> int:
    """Output words a sign-packed tile can take, rounded up to a power of two."""
    return triton.next_power_of_2(-(-tile * packed_bits // WORD_BITS))


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels take it: float8 as int8 (the interpreter cannot load float8; the
    kernels read every value's bits anyway)."""
    return t.view(torch.int8) if t.element_size() == 1 else t


def _kernel_dtype(spec) -> torch.dtype:
    """The dtype of ``_kernel_view`` of a tensor of ``spec``."""
    return torch.int8 if spec.itemsize == 1 else spec.dtype


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _int_class(n: int) -> tuple[bool, bool]:
    """What Triton specializes a (32-bit) integer argument on: being 1, a multiple of 16."""
    return n == 1, n % 16 == 0


def encoder(stream, cursor, appends, spec, geometry, sign_pack, numel, count_nonzeros, report, relu_square=False):
    # Everything that depends only on the arguments given here is worked out once: per call,
    # the launch needs the addresses of the call's tensors and the alignment of three of them.
    tile = geometry.tile_size
    num_tiles = -(-numel // tile)
    device = stream.get_device()
    capacity = stream.numel() - 1
    stream_address, cursor_address, appends_address = stream.data_ptr(), cursor.data_ptr(), appends.data_ptr()
    byte_values = spec.itemsize == 1
    large = capacity >= 1 << 31
    # The Gluon encoder writes a square in whole 32-bit words of values.
    gluon = _gluon_serves(tile, spec, stream) and (not relu_square or numel % (WORD_BITS // spec.bits) == 0)
    if gluon:
        gluon_launcher = _gluon_encode_launchers[spec.bits]
        gluon_programs = -(-num_tiles // gluon_kernels.GROUP)
        gluon_constexprs = (tile, spec.bits, gluon_kernels.GROUP, sign_pack, count_nonzeros, report, relu_square)
        gluon_keys = {
            aligned: (_kernel_dtype(spec), aligned, _int_class(numel), large) + gluon_constexprs
            for aligned in (False, True)
        }
    # Only sign packing needs a persistent grid (for its per-program scratch); without it one
    # program per tile measured faster (docs/benchmarks.md).
    programs = min(num_tiles, _encode_programs(device)) if sign_pack else num_tiles
    tiles_per_program = -(-num_tiles // programs)
    constexprs = (
        tile,
        spec.bits,
        sign_pack,
        _packed_words_block(tile, spec.packed_bits),
        count_nonzeros,
        report,
        not INTERPRETED,
        relu_square,
    )
    key_head = (_kernel_dtype(spec),)
    key_tail = (_aligned(stream),)
    key_end = (_int_class(numel), _int_class(tiles_per_program), large) + constexprs

    def encode_into(x, fixed, base, nonzeros=None, report_word=None, square=None):
        if byte_values:
            x = x.view(torch.int8)
        x_address, fixed_address, base_address = x.data_ptr(), fixed.data_ptr(), base.data_ptr()
        square_arg = x if square is None else square
        square_address = square_arg.data_ptr()
        fixed_aligned = fixed_address % 16 == 0
        report_arg = base if report_word is None else report_word
        nonzeros_arg = cursor if nonzeros is None else nonzeros
        nonzeros_address = cursor_address if nonzeros is None else nonzeros.data_ptr()
        # The report word may be pinned host memory, whose host address is its device address
        # too (unified addressing): as an int, the launcher does not ask the driver for it.
        report_address = base_address if report_word is None else report_word.data_ptr()
        if gluon and x_address % 16 == 0 and square_address % 16 == 0:  # it moves both in 16-byte vectors
            key = gluon_keys[fixed_aligned]
            direct = gluon_launcher.ready(device, key)
            if direct is None:
                args = (x, stream, fixed, cursor, appends, base, report_arg, nonzeros_arg, square_arg)
                tail = (numel, capacity, num_tiles, gluon_programs) + gluon_constexprs
                gluon_launcher(gluon_programs, device, key, args + tail)
                return
            args = (x_address, stream_address, fixed_address, cursor_address, appends_address, base_address)
            args += (report_address, nonzeros_address, square_address, numel, capacity, num_tiles, gluon_programs)
            gluon_launcher.launch(direct, gluon_programs, device, args + gluon_constexprs)
            return
        key = key_head + (x_address % 16 == 0, square_address % 16 == 0) + key_tail + (fixed_aligned,) + key_end
        scratch = torch.empty(programs * tile, dtype=spec.bits_dtype, device=x.device) if sign_pack else x
        direct = _encode_launcher.ready(device, key)
        if direct is None:
            args = (x, stream, fixed, cursor, appends, base, report_arg, nonzeros_arg, scratch, square_arg)
            tail = (numel, capacity, num_tiles, programs, tiles_per_program) + constexprs
            _encode_launcher(programs, device, key, args + tail)
            return
        args = (x_address, stream_address, fixed_address, cursor_address, appends_address, base_address)
        args += (report_address, nonzeros_address, scratch.data_ptr(), square_address)
        tail = (numel, capacity, num_tiles, programs, tiles_per_program)
        _encode_launcher.launch(direct, programs, device, args + tail + constexprs)

    return encode_into


def encode(
    x, fixed, stream, cursor, appends, base, spec, geometry, sign_pack, nonzeros=None, report=None, relu_square=None
):
    prepared = encoder(
        stream,
        cursor,
        appends,
        spec,
        geometry,
        sign_pack,
        x.numel(),
        nonzeros is not None,
        report is not None,
        relu_square is not None,
    )
    prepared(x, fixed, base, nonzeros, report, relu_square)


def measure(x, cursor, appends, spec, geometry, sign_pack, report=None, relu_square=None):
    x = _kernel_view(x)
    numel = x.numel()
    if numel == 0:
        if report is not None:
            report.copy_(cursor + 1, non_blocking=True)
        return
    _launch_measure(x, cursor, appends, report, None, spec, geometry, sign_pack, relu_square)


def measure_tiles(x, tile_words, spec, geometry, sign_pack, relu_square=None):
    x = _kernel_view(x)
    if x.numel():
        _launch_measure(x, None, None, None, tile_words, spec, geometry, sign_pack, relu_square)


def _launch_measure(x, cursor, appends, report, tile_words, spec, geometry, sign_pack, relu_square):
    """Launch ``_measure_kernel`` over ``x`` (not empty): per tile into ``tile_words`` when
    given, else into ``cursor`` (and ``report``)."""
    numel, tile = x.numel(), geometry.tile_size
    programs = -(-numel // (tile * MEASURE_TILES_PER_PROGRAM))
    square = x if relu_square is None else relu_square
    per_tile = tile_words is not None
    if per_tile:  # the pointers of the other mode are passed where the kernel reads none
        pointers = (x, tile_words, tile_words, tile_words, square, tile_words)
    else:
        pointers = (x, cursor, appends, cursor if report is None else report, square, cursor)
    constexprs = (
        tile,
        spec.bits,
        MEASURE_TILES_PER_PROGRAM,
        sign_pack,
        report is not None,
        relu_square is not None,
        per_tile,
    )
    args = pointers + (numel, programs) + constexprs
    key = (x.dtype, _aligned(x), _aligned(square), _int_class(numel)) + constexprs
    _measure_launcher(programs, x.get_device(), key, args)


def decoder(stream, spec, geometry, sign_pack, numel):
    tile = geometry.tile_size
    num_tiles = -(-numel // tile)
    device = stream.get_device()
    stream_address = stream.data_ptr()
    byte_values = spec.itemsize == 1
    # Measured (docs/benchmarks.md): the Gluon decoder is faster for 8- and 16-bit values and
    # where tiles may be packed, the portable one for raw 32-bit values.
    gluon = (sign_pack or spec.bits < 32) and _gluon_serves(tile, spec, stream)
    launcher = _gluon_decode_launchers[spec.bits] if gluon else _decode_launcher
    programs = num_tiles if gluon else num_tiles * DECODE_PARTS[sign_pack]
    tail = (numel, num_tiles)
    # By what is written beside ``out``: nothing, the square, the square and the gradient.
    epilogues = ((False, False), (True, False), (True, True))
    if gluon:
        constexprs = {e: (tile, spec.bits, sign_pack, *e) for e in epilogues}
    else:
        parts = DECODE_PARTS[sign_pack]
        constexprs = {e: (tile, spec.bits, sign_pack, not INTERPRETED, parts, *e) for e in epilogues}
    dtype = _kernel_dtype(spec)
    stream_aligned = _aligned(stream)

    def decode_into(fixed, base, out, square=None, square_grad=None):
        if num_tiles == 0:
            return
        if byte_values:
            out = out.view(torch.int8)
        square_arg = out if square is None else square
        grad_arg = out if square_grad is None else square_grad
        addresses = (out.data_ptr(), square_arg.data_ptr(), grad_arg.data_ptr())
        fixed_address = fixed.data_ptr()
        epilogue = constexprs[square is not None, square_grad is not None]
        key = (dtype, *(address % 16 == 0 for address in addresses), stream_aligned, fixed_address % 16 == 0)
        key += (_int_class(numel),) + epilogue
        direct = launcher.ready(device, key)
        if direct is None:
            args = (out, square_arg, grad_arg, stream, fixed, base) + tail + epilogue
            launcher(programs, device, key, args)
            return
        args = addresses + (stream_address, fixed_address, base.data_ptr()) + tail
        launcher.launch(direct, programs, device, args + epilogue)

    return decode_into


def decode(fixed, stream, base, out, spec, geometry, sign_pack, square=None, square_grad=None):
    decoder(stream, spec, geometry, sign_pack, out.numel())(fixed, base, out, square, square_grad)
