"""What a pack hook returns in place of a saved tensor, and how unpack restores it.

Every handle restores a tensor of the original size, dtype and device, equal bit for bit.
A handle counts the saved slots that hold it; within one backward, the decoded tensor is
kept until every slot has been unpacked, then dropped (a second backward decodes again).
Unpacking never frees storage: that happens when autograd releases the handle.

While saved-tensor hooks are installed, autograd no longer checks that a saved tensor was
not modified in place before backward used it. Unpacking checks it instead (``check_version``),
with autograd's error: a tensor kept as it is would otherwise give a wrong gradient silently.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from bitsparse.codecs import Codec, relu
from bitsparse.compressed import MAX_NUMEL, ValueBuffer
from bitsparse.format import SUPPORTED_DTYPES, TileGeometry, dtype_spec
from bitsparse.hooks.spans import span_end


def check_version(t: torch.Tensor, version: int) -> None:
    """Raise autograd's error if ``t`` changed in place since it was saved at ``version``."""
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: a {t.dtype} tensor of shape {list(t.shape)} was saved for backward at version "
            f"{version} and is at version {t._version} (BitSparse checks this for autograd, which cannot "
            "while saved-tensor hooks are installed). Hint: make the in-place operation out of place, or "
            "modify a clone of the tensor."
        )


class Handle:
    """Base: slot counting, the per-backward cache of the restored tensor, and the version
    check of the saved tensor it stands for."""

    __slots__ = ("slots", "start", "_unpacked", "_cache", "_saved", "_saved_version", "__weakref__")

    def __init__(self, start: int = 0):
        self.slots = 0
        self.start = start
        """The storage offset of the tensor this handle restores: a view of the saved
        storage at offset ``o`` is the restored tensor's elements from ``o - start``."""
        self._unpacked = 0
        self._cache: torch.Tensor | None = None
        self._saved: weakref.ref | None = None
        self._saved_version = 0

    def watch(self, saved: weakref.ref, version: int) -> None:
        """Remember the saved tensor that ``saved`` refers to, and its ``version``, for unpack
        to check. A handle serving several slots watches the first: the others are that
        tensor or views of it, which share its version counter."""
        if self._saved is None:
            self._saved, self._saved_version = saved, version

    def watches(self, t: torch.Tensor) -> bool:
        """Whether this handle watches ``t`` itself, at ``t``'s current version."""
        return self._saved is not None and self._saved() is t and self._saved_version == t._version

    def _restore(self) -> torch.Tensor:
        raise NotImplementedError

    def tensor(self) -> torch.Tensor:
        """The restored tensor, decoded at most once per backward."""
        if self._cache is None:
            self._cache = self._restore()
        return self._cache

    def unpack(self) -> torch.Tensor:
        """Restore for one saved slot; after the last slot of a backward, drop the cache.

        Raises:
            RuntimeError: the saved tensor, still alive, was modified in place since.
        """
        saved = self._saved() if self._saved is not None else None
        if saved is not None:
            check_version(saved, self._saved_version)
        value = self.tensor()
        self._unpacked += 1
        if self._unpacked >= self.slots:
            self._unpacked = 0
            self._cache = None
        return value


class Site:
    """A save site: where in the model tensors come from (their producer, or a compiled
    graph's name for it) with their shape, strides and dtype, and what storing each of them
    takes, worked out once at its first tensor: every step stores the same tensors again.

    ``name`` is what the session learns about (whether the site pays). Tensors are compressed
    in their memory order (``order``, see ``memory_order``), so that they are restored with
    their own strides. ``kept`` says why the site's tensors are kept as they are, if they are:
    a dtype the format does not store, too many elements for one append, strides that no
    permutation makes contiguous, or a site the session learned does not pay (``learn``).
    ``encode`` and ``decode`` are the codec prepared for the arena's value buffer ``values``
    (``prepare``), and ``forget_buffer`` drops them when the arena changes its buffer, so that
    nothing here keeps an old one alive.

    A site of ``relu_inputs`` (a compiled graph's, see ``hooks/graph_passes.py``) is given the
    inputs of a ReLU: what it stores and restores is their ReLU, and storing one writes that
    ReLU's square too (the codecs' ``relu_square``).
    """

    __slots__ = (
        "name", "shape", "stride", "dtype", "device", "order", "stored_shape", "numel", "dense_bytes", "dense_words",
        "spec",
        "fixed_words", "max_value_words", "codec", "sign_pack", "relu_inputs", "values", "encode", "decode",
        "kept", "arena", "arena_options",
    )  # fmt: skip

    def __init__(
        self, name, t: torch.Tensor, codec: Codec, sign_pack: bool, geometry: TileGeometry, relu_inputs: bool = False
    ):
        self.name = name
        self.relu_inputs = relu_inputs
        self.shape, self.stride, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device
        self.numel = t.numel()
        self.dense_bytes = self.numel * t.element_size()
        self.dense_words = -(-self.dense_bytes // 4)
        self.order = memory_order(t)
        self.codec, self.sign_pack = codec, sign_pack
        # ``arena``: the arena the session stores this site's tensors in, for ``arena_options``.
        self.forget_buffer()
        self.kept: str | None = None
        """Why the site's tensors are kept as they are (a reason of ``Stats.tensors_skipped``),
        or None: they are stored."""
        if t.dtype not in SUPPORTED_DTYPES:
            self.kept = "dtype"
            return  # nothing of the format applies
        if self.numel > MAX_NUMEL:
            self.kept = "large"
        elif self.order is None:
            self.kept = "overlapping_or_gapped"
        self.stored_shape = t.permute(self.order).shape if self.order else t.shape
        self.spec = dtype_spec(t.dtype)
        self.fixed_words = geometry.fixed_nbytes(self.numel) // 4
        self.max_value_words = geometry.max_stream_words(self.numel, self.spec.bits)

    def learn(self, unprofitable: bool) -> None:
        """Take what the session learned of the site's name: whether its tensors pay."""
        if self.kept is None or self.kept == "unprofitable_site":
            self.kept = "unprofitable_site" if unprofitable else None

    def prepare(self, values: ValueBuffer, geometry: TileGeometry, report: bool) -> None:
        """Prepare the codec to append to ``values`` (with report words when ``report``)."""
        words, cursor, appends = values.words, values.cursor, values.appends
        encode = self.codec.encoder(
            words, cursor, appends, self.spec, geometry, self.sign_pack, self.numel, True, report, self.relu_inputs
        )
        decode = self.codec.decoder(words, self.spec, geometry, self.sign_pack, self.numel)
        # One statement, which an exception (Ctrl-C) cannot cut: ``values`` says what is prepared.
        self.values, self.encode, self.decode = values, encode, decode

    def forget_buffer(self) -> None:
        """Drop the prepared codec and the arena (another may serve the next tensors)."""
        self.values = self.encode = self.decode = None
        self.arena = self.arena_options = None

    def in_memory_order(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, of the site's shape and strides, with its dims in memory order: contiguous,
        the view the codec reads and writes."""
        return t.permute(self.order) if self.order else t


def memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation of ``t``'s dims that makes it contiguous: ``()`` when ``t`` is already,
    None when no permutation does (overlapping or gapped strides)."""
    if t.is_contiguous():
        return ()
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d])))
    return order if t.permute(order).is_contiguous() else None


class StoredTensor(Handle):
    """A tensor of ``site`` compressed into an arena, or kept dense where it could not be.

    ``fixed`` and ``base`` are its masks and tile words and the word holding where its values
    start (None when it was kept dense), ``decode`` the codec that restores it, and ``lease``
    the arena's claim on what it stores, released with the handle. When ``held``, ``dense``
    keeps the original tensor (and serves unpacks) until the arena confirms that the values
    fit, and for good if they did not (a fallback); a tensor sure to fit is not held.

    A held tensor is read only at the version it was saved at (``dense_version``): its memory
    is the original's, which an in-place op may have changed since, even after the original
    tensor itself was dropped. Compressed values are the saved ones whatever happens to it.
    """

    __slots__ = ("site", "fixed", "base", "decode", "dense", "dense_version", "lease")

    def __init__(self, dense: torch.Tensor, site: Site, fixed=None, base=None, lease=None, held: bool = True):
        super().__init__(dense.storage_offset())
        self.site, self.fixed, self.base, self.lease = site, fixed, base, lease
        self.decode = site.decode if fixed is not None else None
        # Detached: a saved tensor's grad_fn may be the node that saves it, which would hold
        # it in a reference cycle through autograd. The alias shares the version counter.
        self.dense = dense.detach() if held else None
        self.dense_version = dense._version

    def outlived(self) -> bool:
        """Whether the tensor this handle was saved for is still alive (the handle refers to
        it weakly, and to its memory only through an alias): asked as backward begins, held
        elsewhere since the forward (by the caller, or by a graph that saved it without these
        hooks), so that storing it freed none of its memory."""
        return self._saved is not None and self._saved() is not None

    def confirm(self, fits: bool) -> None:
        """Take the arena's confirmation of a held tensor: the values fit (the dense storage
        can go), or not (it stays, for good, and the arena holds nothing in its place: its
        lease no longer counts the dense words against the arena's memory, see
        ``Lease.words``)."""
        if fits:
            self.dense = None
        elif self.lease is not None:
            self.lease.words = 0

    def keep_copy(self) -> None:
        """Keep a copy of the dense tensor's elements rather than its memory, which its owner
        may write over (a compiled graph's buffer, past its last use there)."""
        kept = self._kept()
        span = span_end(kept) - self.start  # the storage elements it touches, overlapping strides included
        storage = self.dense.untyped_storage()
        self.dense = kept.new_empty(0).set_(storage, self.start, (span,), (1,)).clone()
        self.dense_version, self.start = self.dense._version, 0

    @property
    def is_compressed(self) -> bool:
        """Whether the tensor is held compressed (it fit, or is sure to), not dense."""
        return self.dense is None

    def _restore(self) -> torch.Tensor:
        site = self.site
        if self.dense is not None:
            kept = self._kept()
            return relu(kept) if site.relu_inputs else kept
        out = torch.empty_strided(site.shape, site.stride, dtype=site.dtype, device=site.device)
        self.decode(self.fixed, self.base, site.in_memory_order(out))
        return out

    def _kept(self) -> torch.Tensor:
        """The tensor kept dense (a ReLU's input at a site of ``relu_inputs``).

        Raises:
            RuntimeError: it was modified in place since it was saved.
        """
        dense, site = self.dense, self.site
        if dense._version != self.dense_version:
            check_version(dense, self.dense_version)
        kept = torch.empty(0, dtype=site.dtype, device=site.device)
        return kept.set_(dense.untyped_storage(), self.start, site.shape, site.stride)

    def restore_into(self, out: torch.Tensor, square=None, square_grad=None) -> None:
        """Write the restored tensor into ``out``, a tensor of the site's shape, strides and
        dtype that the caller allocated (a compiled backward's own buffer).

        Given ``square`` and ``square_grad`` (the restored tensor ``r`` a ReLU's output,
        ``square_grad`` the gradient of ``r ** 2``; contiguous, like ``out``, which must be
        too), ``square`` receives ``r ** 2`` and ``out`` the gradient of the ReLU's input in
        place of ``r``, as the codec's ``relu_square_backward`` computes them: decoded, in
        the same pass."""
        site = self.site
        if self.dense is None:
            self.decode(self.fixed, self.base, site.in_memory_order(out), square, square_grad)
        elif square_grad is None:
            out.copy_(self._restore())
        else:
            site.codec.relu_square_backward(self._kept(), square_grad, square, out, site.relu_inputs)

    def squared(self, square: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The elementwise square of the restored tensor, as ``square`` computes it, which
        the decoder's fused square was checked to match (``ExactnessChecks.fused_square``).

        When this backward has not restored the tensor yet, it is decoded together with its
        square in one pass and kept for this handle's own slots, as ``tensor()`` would.
        """
        if self._cache is not None or self.dense is not None:
            return square(self.tensor())
        site = self.site
        value = torch.empty_strided(site.shape, site.stride, dtype=site.dtype, device=site.device)
        squared = torch.empty_like(value)
        self.decode(self.fixed, self.base, site.in_memory_order(value), site.in_memory_order(squared))
        self._cache = value
        return squared


class Derived(Handle):
    """Base of the handles that compute their tensor at unpack from other tensors (restored
    by other handles, or kept as they are).

    ``like`` is the saved view of the tensor computed: ``size``, ``stride`` and ``offset``
    place it in the new tensor, whose dtype is ``dtype``.
    """

    __slots__ = ("dtype", "offset", "size", "stride")

    def __init__(self, like: torch.Tensor):
        super().__init__()
        self.size, self.stride, self.offset, self.dtype = like.shape, like.stride(), like.storage_offset(), like.dtype


class SquareOf(Derived):
    """The square of the whole tensor a ``StoredTensor`` restores (``relu(x) ** 2`` saved
    for backward), decoded in the same pass as the tensor (see ``StoredTensor.squared``)."""

    __slots__ = ("source", "square")

    def __init__(self, source: StoredTensor, square: Callable[[torch.Tensor], torch.Tensor], like: torch.Tensor):
        super().__init__(like)
        self.source, self.square = source, square

    def _restore(self) -> torch.Tensor:
        squared = self.source.squared(self.square)
        if (squared.shape, squared.stride(), self.offset) == (self.size, self.stride, 0):
            return squared
        return squared.as_strided(self.size, self.stride, self.offset)


class ViewOf(Handle):
    """A view of a tensor another handle stores (the same storage saved twice).

    ``size``, ``stride`` and ``offset`` place the view in the source's restored tensor,
    ``offset`` counted from where that tensor starts in its storage.
    """

    __slots__ = ("source", "size", "stride", "offset")

    def __init__(self, source: Handle, size, stride, offset: int):
        super().__init__()
        self.source = source
        self.size, self.stride, self.offset = size, stride, offset

    def _restore(self) -> torch.Tensor:
        # A decoded tensor starts its own storage; one kept dense is the original, which may
        # start further into its storage (a slice).
        restored = self.source.tensor()
        return restored.as_strided(self.size, self.stride, restored.storage_offset() + self.offset)


class Recomputed(Derived):
    """A tensor recomputed at unpack with the op that computed it in the forward, so with the
    same bits, from its operands: other handles' tensors (a ReLU output, for its square; a
    square, for a ReLU²-GLU's product), or tensors kept as they are, with the versions they
    were saved at (a ReGLU's ``u`` in ``relu(g) * u``)."""

    __slots__ = ("op", "sources")

    def __init__(self, sources: tuple, op: Callable[..., torch.Tensor], like: torch.Tensor):
        super().__init__(like)
        self.sources = sources
        self.op = op

    def _restore(self) -> torch.Tensor:
        operands = []
        for source in self.sources:
            if source.__class__ is tuple:
                kept, version = source
                check_version(kept, version)
                operands.append(kept)
            else:
                # Not source.tensor(): that would keep the source's view cached for as long as
                # this handle lives. The stored tensor underneath still decodes once per backward.
                operands.append(source._restore())
        return self.op(*operands).as_strided(self.size, self.stride, self.offset)
