"""Codecs: implementations of the format in ``bitsparse.format``, behind one interface.

A codec has two entry points, both shaped like ``torch.library`` custom ops: every output
is a preallocated argument whose shape the host knows, and everything whose size depends on
the data (the value stream) goes into a caller-provided word buffer at a position held in a
device tensor. Neither entry point synchronizes with the host.

``encode(x, fixed, stream, cursor, appends, base, spec, geometry, sign_pack, nonzeros=None, report=None,
relu_square=None)``
    Reads the bits of ``x`` (a contiguous tensor of ``spec.dtype``, at least one element)
    in flattened order, writes ``fixed`` (int32 ``[num_tiles * (mask_words + 1)]``: the
    masks, ``mask_words`` per tile, then one tile word per tile), appends the value stream to
    ``stream`` (int32 words; the last word is a guard that is never allocated) and advances
    ``cursor`` (int64 ``[1]``) by the words used. ``base`` (int64 ``[1]``) receives the
    cursor as it was before the call: tile offsets are relative to it. ``appends`` (int64
    ``[2]``) is scratch that is zero before and after the call (see ``ValueBuffer``). A tile
    that does not fit below the guard is not written; the caller learns this from the
    cursor, which still advances past the capacity. When given, ``nonzeros`` (int64 ``[1]``)
    is incremented by the number of stored elements (for statistics), and ``report`` (int64
    ``[1]``, zero) receives the new cursor plus one as the last thing the call writes.
    When given, ``relu_square`` (contiguous, like ``x``; float16, bfloat16 or float32 only)
    makes ``x`` the input of a ReLU: what is stored is ``relu(x)``, which keeps the bits of
    every element not below zero (``-0.0`` and NaNs included) and is ``+0.0`` elsewhere, and
    ``relu_square`` receives its elementwise square, computed in float32 and rounded to
    nearest even, as compiled code computes ``relu(x) ** 2``. A compiled forward that saves a
    ReLU output and squares it then reads its input once, and writes neither the ReLU output
    nor a second copy of it.

``measure(x, cursor, appends, spec, geometry, sign_pack, report=None, relu_square=None)``
    Advances ``cursor`` by the words ``encode`` would append for ``x`` and, when given,
    reports the new cursor plus one in ``report`` and writes ``relu_square`` as ``encode``
    does; writes nothing else. An allocator measures what it has no room for, to size itself
    for the next step.

``measure_tiles(x, tile_words, spec, geometry, sign_pack, relu_square=None)``
    Writes into ``tile_words`` (int32, one element per tile of ``x``; memory the device can
    write, pinned host memory included) the stream words ``encode`` would append for each
    tile, and ``relu_square`` as ``encode`` does; writes nothing else, and needs no
    counters: an allocator that holds no device memory yet measures with it.

``decode(fixed, stream, base, out, spec, geometry, sign_pack, square=None, square_grad=None)``
    Writes every element of ``out`` (a contiguous tensor of ``spec.dtype``, restored in
    flattened order). ``sign_pack`` says whether packed tiles may occur (a fast path when
    they cannot). When given, ``square`` (like ``out``; float16, bfloat16 or float32 only)
    receives the elementwise square of the result as ``torch.square`` computes it, in the
    same pass: backward needs both a ReLU's output and its square, and rereading the output
    to square it cost as much memory traffic as decoding it. When given too, ``square_grad``
    (like ``out``) is the gradient of that square, the restored tensor is a ReLU's output,
    and ``out`` receives not that tensor but the gradient of the ReLU's input, ``square`` and
    ``out`` the bits ``relu_square_backward`` writes for the restored tensor: a compiled
    backward of ``relu(x) ** 2`` then reads the stored tensor and the gradient once, and
    neither writes the ReLU's output nor reads it back.

``relu_square_backward(r, square_grad, square, grad_input, relu_input=False)``
    The backward of ``relu(x) ** 2`` as compiled code computes it from the ReLU's output
    ``r`` and the square's gradient ``square_grad``: writes ``r ** 2`` into ``square`` and
    the gradient of ``x``, ``where(r <= 0, 0, square_grad * (r * 2))``, into
    ``grad_input``, each computed in float32 and rounded once to the dtype (nearest even).
    With ``relu_input``, ``r`` is the ReLU's input, and its ReLU (``relu``) is used in its
    place. Every tensor is contiguous, of one dtype of ``SQUARE_DTYPES`` and element count.
    For a tensor kept dense where its handle would decode it with ``square_grad``; whatever
    it allocates stays small beside the tensors.

``encoder(stream, cursor, appends, spec, geometry, sign_pack, numel, count_nonzeros, report, relu_square=False)``
    ``encode`` prepared for many calls with the same stream and kind of tensor: returns
    ``encode_into(x, fixed, base, nonzeros=None, report=None, square=None)``, which does what
    ``encode`` does for an ``x`` of ``numel`` elements, given ``nonzeros`` exactly when
    ``count_nonzeros``, ``report`` exactly when ``report`` and ``square`` (``encode``'s
    ``relu_square``) exactly when ``relu_square`` was true. An allocator that
    stores a save site's tensors step after step prepares once: a call then costs little
    more host time than the kernel launch.

``decoder(stream, spec, geometry, sign_pack, numel)``
    ``decode`` prepared likewise: returns ``decode_into(fixed, base, out, square=None,
    square_grad=None)``.

Backends: ``"torch"`` (vectorised PyTorch, any device) and ``"triton"`` (CUDA, or the CPU under
``TRITON_INTERPRET=1``). Both write the same masks and tile encodings; the order of tiles in
the value stream may differ (the Triton encoder claims space with an atomic counter), which
the per-tile offsets make invisible to decoding.
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol

import torch

from bitsparse.format import DTypeSpec, TileGeometry

BACKENDS = ("torch", "triton")
SQUARE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes whose squares the codecs write (``decode``'s ``square``, ``encode``'s ``relu_square``)."""


class Codec(Protocol):
    name: str

    def check_device(self, device: torch.device) -> None:
        """Raise ``ValueError`` when this codec cannot run on ``device``."""

    def encode(
        self,
        x: torch.Tensor,
        fixed: torch.Tensor,
        stream: torch.Tensor,
        cursor: torch.Tensor,
        appends: torch.Tensor,
        base: torch.Tensor,
        spec: DTypeSpec,
        geometry: TileGeometry,
        sign_pack: bool,
        nonzeros: torch.Tensor | None = None,
        report: torch.Tensor | None = None,
        relu_square: torch.Tensor | None = None,
    ) -> None: ...

    def measure(
        self,
        x: torch.Tensor,
        cursor: torch.Tensor,
        appends: torch.Tensor,
        spec: DTypeSpec,
        geometry: TileGeometry,
        sign_pack: bool,
        report: torch.Tensor | None = None,
        relu_square: torch.Tensor | None = None,
    ) -> None: ...

    def measure_tiles(
        self,
        x: torch.Tensor,
        tile_words: torch.Tensor,
        spec: DTypeSpec,
        geometry: TileGeometry,
        sign_pack: bool,
        relu_square: torch.Tensor | None = None,
    ) -> None: ...

    def encoder(
        self,
        stream: torch.Tensor,
        cursor: torch.Tensor,
        appends: torch.Tensor,
        spec: DTypeSpec,
        geometry: TileGeometry,
        sign_pack: bool,
        numel: int,
        count_nonzeros: bool,
        report: bool,
        relu_square: bool = False,
    ) -> Callable[..., None]: ...

    def decoder(
        self, stream: torch.Tensor, spec: DTypeSpec, geometry: TileGeometry, sign_pack: bool, numel: int
    ) -> Callable[..., None]: ...

    def decode(
        self,
        fixed: torch.Tensor,
        stream: torch.Tensor,
        base: torch.Tensor,
        out: torch.Tensor,
        spec: DTypeSpec,
        geometry: TileGeometry,
        sign_pack: bool,
        square: torch.Tensor | None = None,
        square_grad: torch.Tensor | None = None,
    ) -> None: ...

    def relu_square_backward(
        self,
        r: torch.Tensor,
        square_grad: torch.Tensor,
        square: torch.Tensor,
        grad_input: torch.Tensor,
        relu_input: bool = False,
    ) -> None: ...


def relu(x: torch.Tensor) -> torch.Tensor:
    """The ReLU of ``x`` that ``encode`` stores for ``relu_square``: ``+0.0`` where ``x`` is
    below zero, and the bits of ``x`` elsewhere (``-0.0`` and NaNs included), as compiled code
    computes ``relu``."""
    return x.masked_fill(x < 0, 0)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether the Triton backend can be imported (Triton is installed)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_codec(backend: str | None, device: torch.device) -> Codec:
    """Return the codec named ``backend``, or the default one for ``device``.

    The default is ``"triton"`` on CUDA devices when Triton is installed, else ``"torch"``.

    Raises:
        ValueError: unknown backend name, or a backend that cannot run on ``device``.
        ImportError: ``backend="triton"`` without Triton installed.
    """
    if backend is None:
        backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    key = (backend, device.type)
    codec = _checked.get(key)
    if codec is not None:
        return codec
    if backend == "torch":
        from bitsparse.codecs import torch_codec as codec
    elif backend == "triton":
        if not triton_available():
            raise ImportError(
                "backend='triton' needs the triton package (pip install triton); backend='torch' works without it"
            )
        from bitsparse.codecs import triton_codec as codec
    else:
        raise ValueError(f"unknown backend {backend!r}: choose one of {BACKENDS} or None")
    codec.check_device(device)
    _checked[key] = codec
    return codec


_checked: dict[tuple, Codec] = {}
"""Codecs already checked for a (backend, device type): the hooks look one up per tensor."""
