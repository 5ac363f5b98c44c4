"""The pack and unpack hooks: which saved tensors to compress, and where they go.

``Session`` holds what outlives one forward pass: an arena per device, the marked tensors,
the tables of stored tensors (to store each once, and to find a square's source) and the
statistics of the step.
A step begins at the first pack after every handle of the previous step was released.
The hooks only call the public codec API; they know nothing of the kernels' insides.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field, fields

import psutil
import torch

from bitsparse.allocator import Arena
from bitsparse.codecs import get_codec
from bitsparse.compressed import MAX_NUMEL, compress_unchecked
from bitsparse.format import SUPPORTED_DTYPES, TileGeometry
from bitsparse.hooks.handles import Handle, Recomputed, SquareOf, StoredTensor, ViewOf, check_version
from bitsparse.hooks.provenance import Marks, Provenance, classify_node, node_key, span_end, squared_input

SELECTIONS = ("relu", "all")
CPU_AUTO_CAPACITY = 64 << 20
CUDA_AUTO_FRACTION = 0.125
PROFITABLE_RATIO = 1.1
"""With ``select="all"``, a save site whose tensors shrink less than this is skipped."""


@dataclass(frozen=True)
class Options:
    """How saved tensors are stored; the keyword arguments of ``compressing``/``enable``.

    Attributes:
        capacity: the arena's initial size per device: bytes (int), a fraction of the
            device's free memory (float in (0, 1]; available RAM on the CPU), or "auto" (1/8
            of free CUDA memory, 64 MiB on the CPU). The arena then grows or shrinks between
            steps to fit what the last step needed.
        sign_pack: drop the sign bit of ReLU-family values (never lossy: see ``compress``).
        min_numel: tensors with fewer elements are kept as they are.
        select: "relu" compresses tensors that ReLU-family ops produced (and their squares),
            read from ``grad_fn``, and tries those whose op autograd hides (in-place ops on
            views, threshold) while their save site pays; "all" tries every floating tensor
            and stops trying save sites that do not pay.
        backend: codec backend, as for ``compress`` (None: Triton on CUDA, torch elsewhere).
        window: most compressed tensors whose fit the host has not confirmed yet. Each one
            keeps its dense tensor until confirmed, so a GPU-bound step, where the host runs
            ahead, holds ``window`` dense tensors at its peak; a larger window only helps a
            host that runs ahead in bursts.
        recompute_squares: restore ``relu(x) ** 2`` from the stored ``relu(x)`` rather than
            storing it too, where that is verified bit-identical for the dtype and device.
    """

    capacity: int | float | str = "auto"
    sign_pack: bool = False
    min_numel: int = 1 << 16
    select: str = "relu"
    backend: str | None = None
    window: int = 1
    recompute_squares: bool = True

    def __post_init__(self):
        c = self.capacity
        if isinstance(c, bool) or not (
            c == "auto" or (isinstance(c, int) and c > 0) or (isinstance(c, float) and 0 < c <= 1)
        ):
            raise ValueError(
                f"capacity must be a number of bytes (int > 0), a fraction of free memory "
                f"(float in (0, 1]) or 'auto'; got {c!r}"
            )
        if self.select not in SELECTIONS:
            raise ValueError(f"select must be one of {SELECTIONS}, got {self.select!r}")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {self.min_numel!r}")
        if self.backend not in (None, "torch", "triton"):
            raise ValueError(f"backend must be None, 'torch' or 'triton', got {self.backend!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "Options":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; the options are {sorted(known)}")
        return cls(**kwargs)


@dataclass
class Stats:
    """Accounting for one step: the one in progress, or the last finished one.

    Sizes are in bytes. ``dense_bytes`` is what the compressed tensors took dense and
    ``stored_bytes`` what they take now (masks, tile words and values; a fallback counts
    dense). ``ratio = dense_bytes / stored_bytes``. ``zero_fraction`` is over the compressed
    tensors. Deduplicated and recomputed saves cost nothing and are counted apart.
    ``tensors_skipped`` counts saved tensors kept as they are, by the first reason that
    applies: ``small`` (fewer than ``min_numel`` elements), ``parameter`` (a parameter or a
    view of one), ``not_relu_family`` (``select="relu"`` and neither a ReLU-family producer
    nor a mark), ``dtype``, ``layout_or_device``, ``large`` (more elements than one
    ``compress`` call takes), ``unprofitable_site`` and ``overlapping_or_gapped`` (no
    permutation of the dims makes it contiguous).
    ``fallbacks`` counts tensors kept dense by reason: ``arena_full`` (no room left) and
    ``other_stream`` (saved on another CUDA stream than the step's first stored tensor).
    """

    step: int = 0
    tensors_seen: int = 0
    tensors_compressed: int = 0
    tensors_deduplicated: int = 0
    tensors_recomputed: int = 0
    tensors_skipped: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    dense_bytes: int = 0
    stored_bytes: int = 0
    zero_fraction: float = 0.0
    arena_capacity: int = 0
    arena_peak: int = 0
    window_waits: int = 0

    @property
    def ratio(self) -> float:
        return self.dense_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["ratio"] = self.ratio
        return d

    def __str__(self) -> str:
        mib = 1 << 20
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(self.tensors_skipped.items())) or "none"
        fallbacks = ", ".join(f"{k} {v}" for k, v in sorted(self.fallbacks.items())) or "none"
        return (
            f"step {self.step}: {self.tensors_compressed}/{self.tensors_seen} saved tensors compressed "
            f"(+{self.tensors_deduplicated} shared, {self.tensors_recomputed} recomputed), "
            f"{self.dense_bytes / mib:.1f} MiB -> {self.stored_bytes / mib:.1f} MiB "
            f"({self.ratio:.2f}x, {100 * self.zero_fraction:.1f}% zeros), "
            f"arena {self.arena_peak / mib:.1f}/{self.arena_capacity / mib:.1f} MiB; "
            f"skipped: {skipped}; fallbacks: {fallbacks}"
        )


class _StepCollector:
    """Counters of one step, filled in by packs and by the arenas' asynchronous reports."""

    def __init__(self, step: int):
        self.stats = Stats(step=step)
        self.skipped: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.numel = 0
        self.nonzeros: dict[torch.device, torch.Tensor] = {}
        self.arenas: set = set()

    def finish(self) -> Stats:
        """The step's statistics; synchronizes once to read the device counters."""
        for arena in self.arenas:
            arena.drain()
        s = self.stats
        s.tensors_skipped, s.fallbacks = dict(self.skipped), dict(self.fallbacks)
        nonzeros = sum(int(n) for n in self.nonzeros.values())
        s.zero_fraction = 1 - nonzeros / self.numel if self.numel else 0.0
        usages = [arena.usage() for arena in self.arenas]
        s.arena_capacity = sum(u.capacity for u in usages)
        s.arena_peak = sum(u.peak for u in usages)
        s.window_waits = sum(u.window_waits for u in usages)
        return s


def memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation of ``t``'s dims that makes it contiguous: ``()`` when ``t`` is already,
    None when no permutation does (overlapping or gapped strides)."""
    if t.is_contiguous():
        return ()
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d])))
    return order if t.permute(order).is_contiguous() else None


class Session:
    """Process-wide state behind ``compressing()`` and ``enable()``."""

    def __init__(self):
        self.marks = Marks()
        self._lock = threading.RLock()
        self._arenas: dict[torch.device, tuple[Arena, tuple]] = {}
        self._geometry = TileGeometry()
        self._live = 0
        self._step = 0
        self._collector = _StepCollector(0)
        self._stored: dict[tuple[int, int], list] = {}
        # node_key(grad_fn, output_nr) -> (handle ref, start, shape, stride, offset): see
        # _note_source.
        self._sources: dict[tuple, tuple] = {}
        # id(saved tensor) -> slot ref: the tensors packed this step (the slot watches the
        # tensor it was made for, see Handle.watch).
        self._packed: dict[int, weakref.ref] = {}
        self._unprofitable: set = set()
        self._recompute_verified: dict[tuple, bool] = {}

    # -- hooks ------------------------------------------------------------------------------

    def pack(self, options: Options, t: torch.Tensor):
        # Runs for every saved tensor (about 400 per GPT forward, between the model's ops, where
        # the host often bounds the step), and most are skipped: decide that first, cheaply
        # (the screen reads only the tensor, the options and the marks, so needs no lock).
        reason, provenance = self._screen(t, options)
        with self._lock:
            if self._live == 0 and self._collector.arenas:
                self._begin_step()
            collector = self._collector
            stats = collector.stats
            stats.tensors_seen += 1
            order = site = None
            if reason is None:
                # The same tensor saved again (a square's input is ReLU's output): the same slot.
                again = self._packed.get(id(t))
                slot = again() if again is not None else None
                if slot is not None and slot.watches(t):
                    stats.tensors_deduplicated += 1
                    slot.slots += 1
                    return slot
                # Tensors not proven ReLU-family are compressed only while their site pays.
                if provenance is not Provenance.RELU and (site := self._site(t)) in self._unprofitable:
                    reason = "unprofitable_site"
                else:
                    # Compressed in memory order, the tensor is restored with its own strides
                    # (kernels such as convolutions may round differently on another layout).
                    order = memory_order(t)
                    if order is None:
                        reason = "overlapping_or_gapped"
            if reason is not None:
                collector.skipped[reason] += 1
                # Kept without its history: a tensor saved by the node that made it (tanh's
                # result) would hold that node, which holds it, in a cycle that only backward
                # breaks (Python's collector cannot see it). A parameter's view cannot be: its
                # node is a view's, which saves no tensor. Unpacking restores the history,
                # after checking the version (see handles.check_version).
                if reason == "parameter" or t.grad_fn is None:
                    return t, t._version
                return t.detach(), t._version
            # Confirmed tensors release their dense copy here, during the forward.
            self._poll()
            found = self._find_stored(t)
            if found is not None:
                stats.tensors_deduplicated += 1
            elif options.recompute_squares:
                found = self._recompute(t)
                if found is not None:
                    stats.tensors_recomputed += 1
            if found is None:
                handle = self._store(
                    t,
                    order,
                    options,
                    sign_pack=options.sign_pack and provenance is not None,
                    site=site,
                )
                handle.slots += 1  # it restores t itself, whatever t's strides
                found, slot = (handle, t.storage_offset()), handle
            else:
                slot = self._slot(*found, t)
            self._note_source(t, *found)
            slot.watch(t)
            self._packed[id(t)] = weakref.ref(slot)
            return slot

    def unpack(self, packed) -> torch.Tensor:
        if not isinstance(packed, Handle):  # a tensor kept as it is, and its version
            kept, version = packed
            check_version(kept, version)
            return kept
        with self._lock:
            self._poll()
            return packed.unpack()

    # -- decisions --------------------------------------------------------------------------

    def _screen(self, t: torch.Tensor, options: Options) -> tuple[str | None, Provenance | None]:
        """Why ``t`` is skipped (None if it is not) and its provenance, cheapest checks first."""
        numel = t.numel()
        if numel < options.min_numel or not numel:
            return "small", None
        base = t._base
        if base is None:
            base = t
        if base.requires_grad and base.is_leaf:  # a parameter, or a view of one (weight.t())
            return "parameter", None
        # A view holds its base's values: the base's node says what they are, without
        # walking back through the view's nodes.
        provenance = classify_node(base.grad_fn)
        if provenance is not Provenance.RELU and self.marks.covers(t):
            provenance = Provenance.RELU
        if provenance is None and options.select == "relu":
            return "not_relu_family", None
        if t.dtype not in SUPPORTED_DTYPES:
            return "dtype", provenance
        if t.layout != torch.strided or not (t.is_cuda or t.is_cpu):
            return "layout_or_device", provenance
        if numel > MAX_NUMEL:
            return "large", provenance
        return None, provenance

    @staticmethod
    def _site(t: torch.Tensor) -> tuple:
        """Where in the model ``t`` comes from; all views of one tensor share their site."""
        base = t._base if t._base is not None else t
        return (type(base.grad_fn).__name__, tuple(base.shape), t.dtype)

    # -- storing ----------------------------------------------------------------------------

    def _arena(self, device: torch.device, options: Options) -> Arena:
        """The device's arena; a new one when the options ask for another capacity or window
        (only between steps, when nothing in the old one is alive)."""
        configured = (options.capacity, options.window)
        arena, arena_configured = self._arenas.get(device, (None, None))
        if arena is None or (configured != arena_configured and self._live == 0):
            arena = Arena(device, _initial_capacity(device, options.capacity), window=options.window)
            self._arenas[device] = (arena, configured)
        return arena

    def _store(self, t: torch.Tensor, order, options: Options, sign_pack: bool, site) -> StoredTensor:
        """Compress ``t`` (permuted to ``order``, see ``memory_order``) into the device's
        arena, or keep it dense when the arena is full. If ``site`` is given and the tensor
        does not pay, the site is skipped from then on.

        Either way the handle holds a lease, so the step lasts as long as autograd holds it.
        """
        collector = self._collector
        arena = self._arena(t.device, options)
        lease = _StepLease(self, arena.open_lease())
        collector.arenas.add(arena)
        fixed = None
        if arena.on_append_stream():
            fixed = arena.reserve_fixed(self._geometry.fixed_nbytes(t.numel()) // 4)
            refusal = "arena_full"
        else:
            refusal = "other_stream"
        if fixed is None:
            collector.fallbacks[refusal] += 1
            collector.stats.dense_bytes += t.numel() * t.element_size()
            collector.stats.stored_bytes += t.numel() * t.element_size()
            handle = StoredTensor(None, t, None, lease, None)
            handle.confirm(False)
            return handle
        nonzeros = collector.nonzeros.get(arena.device)
        if nonzeros is None:
            nonzeros = collector.nonzeros[arena.device] = torch.zeros(1, dtype=torch.int64, device=arena.device)
        codec = get_codec(options.backend, arena.device)
        compressed = compress_unchecked(
            t.permute(order) if order else t,
            codec,
            self._geometry,
            arena.values,
            fixed,
            sign_pack,
            nonzeros,
            arena.next_report(),
            arena.next_start(),
        )
        handle = StoredTensor(compressed, t, codec, lease, order)
        stats = collector.stats
        stats.tensors_compressed += 1
        stats.dense_bytes += compressed.dense_nbytes
        collector.numel += t.numel()
        arena.submit(
            _confirmation(
                weakref.ref(handle),
                collector,
                capacity=arena.values.capacity,
                fixed_bytes=fixed.numel() * 4,
                dense_bytes=compressed.dense_nbytes,
                site=site,
                unprofitable=self._unprofitable,
            )
        )
        if t.is_contiguous():
            self._remember(t, handle)
        return handle

    def _remember(self, t: torch.Tensor, handle: Handle) -> None:
        """Note that ``handle`` restores ``t``'s span, valid while ``t``'s storage lives."""
        storage = t.untyped_storage()
        self._stored.setdefault((storage.data_ptr(), t._version), []).append(
            (t.storage_offset(), span_end(t), t.dtype, weakref.ref(handle), weakref.ref(storage))
        )

    def _find_stored(self, t: torch.Tensor) -> tuple[Handle, int] | None:
        """A handle already restoring ``t``'s elements (the same storage saved again)."""
        offset, end = t.storage_offset(), span_end(t)
        storage_address = t.data_ptr() - offset * t.element_size()  # without making a storage object
        for start, stop, dtype, handle_ref, storage_ref in self._stored.get((storage_address, t._version), ()):
            handle = handle_ref()
            alive = storage_ref() is not None and handle is not None
            if alive and dtype == t.dtype and start <= offset and end <= stop:
                return handle, start
        return None

    def _recompute(self, t: torch.Tensor) -> tuple[Handle, int] | None:
        """A handle that restores ``t`` as the square of a tensor already handled, if it is
        one (``t`` may be a view of the square's result)."""
        result = t._base if t._base is not None else t
        edge = squared_input(result.grad_fn)
        source = self._sources.get(node_key(*edge)) if edge is not None and edge[0] is not None else None
        handle = source[0]() if source is not None else None
        if handle is None:
            return None
        _, start, shape, stride, offset = source
        # The square of a contiguous tensor is a new contiguous tensor of its shape.
        if result.shape != shape or result.storage_offset() != 0 or not result.is_contiguous():
            return None
        source_view = ViewOf(handle, shape, stride, offset - start)
        key = (result.dtype, result.device.type)
        if key not in self._recompute_verified:
            # Once per dtype and device: is the recomputed square the forward's, bit for bit?
            recomputed = torch.square(source_view._restore())
            self._recompute_verified[key] = bool(
                torch.equal(recomputed.view(torch.uint8), result.detach().view(torch.uint8))
            )
            handle._cache = None  # nothing decoded stays alive
        if not self._recompute_verified[key]:
            return None
        if isinstance(handle, StoredTensor) and _whole(handle, shape, offset - start):
            recomputed_handle = SquareOf(handle, result)  # decoded with its source, in one pass
        else:
            recomputed_handle = Recomputed(source_view, torch.square, result, 0)
        self._remember(result, recomputed_handle)
        return recomputed_handle, 0

    def _note_source(self, t: torch.Tensor, handle: Handle, start: int) -> None:
        """Note that ``handle`` (restoring storage from ``start``) restores ``t``, under
        ``t``'s autograd identity, for a square of ``t`` to find (last write wins: a tensor
        modified in place is packed again before it is squared)."""
        if t.grad_fn is not None and t.is_contiguous():
            key = node_key(t.grad_fn, t.output_nr)
            self._sources[key] = (weakref.ref(handle), start, t.shape, t.stride(), t.storage_offset())

    @staticmethod
    def _slot(handle: Handle, start: int, t: torch.Tensor) -> Handle:
        """Count one more saved slot: ``handle`` itself, or a view of it if ``t`` is a view."""
        if not _same_geometry(handle, t, start):
            handle = ViewOf(handle, t.shape, t.stride(), t.storage_offset() - start)
        handle.slots += 1
        return handle

    # -- life cycle -------------------------------------------------------------------------

    def poll(self) -> None:
        """Deliver the arenas' completed reports (never blocks)."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        for arena, _ in self._arenas.values():
            arena.poll()

    def _begin_step(self) -> None:
        self._step += 1
        self._collector = _StepCollector(self._step)
        self._forget_saved()

    def _released(self) -> None:
        with self._lock:
            self._live -= 1
            if self._live == 0:
                self._forget_saved()
                self.marks.clear()

    def _forget_saved(self) -> None:
        """Drop the lookups of what this step saved (they refer to its tensors and handles)."""
        self._stored.clear()
        self._sources.clear()
        self._packed.clear()

    def stats(self) -> Stats:
        with self._lock:
            return copy.deepcopy(self._collector.finish())

    def begin_step_if_idle(self) -> None:
        """Start a new step now if nothing of the last one is alive (``compressing()`` entry)."""
        with self._lock:
            if self._live == 0 and self._collector.stats.tensors_seen:
                self._begin_step()

    def reset(self) -> None:
        """Forget arenas and learned state (only when nothing is stored)."""
        with self._lock:
            if self._live:
                raise RuntimeError("cannot reset while compressed tensors are alive; run backward first")
            self._arenas.clear()
            self._unprofitable.clear()
            self._recompute_verified.clear()


def _whole(handle: StoredTensor, shape: torch.Size, offset: int) -> bool:
    """Whether the contiguous view of ``shape`` at ``offset`` in what ``handle`` stores is all of it."""
    return handle.compressed is not None and offset == 0 and shape == handle.compressed.shape


def _same_geometry(handle: Handle, t: torch.Tensor, start: int) -> bool:
    """Whether ``t`` is exactly the tensor ``handle`` restores (stored at ``start``)."""
    if isinstance(handle, StoredTensor):
        # Only contiguous stored tensors are shared (see _remember).
        return t.storage_offset() == start and t.is_contiguous() and t.shape == handle.compressed.shape
    return (t.shape, t.stride(), t.storage_offset() - start) == (handle.size, handle.stride, handle.offset)


class _StepLease:
    """An arena lease that also counts the session's live handles."""

    __slots__ = ("_session", "_lease")

    def __init__(self, session: Session, lease):
        self._session, self._lease = session, lease
        session._live += 1

    def release(self) -> None:
        if self._lease is not None:
            lease, self._lease = self._lease, None
            lease.release()
            self._session._released()


def _confirmation(handle_ref, collector, *, capacity, fixed_bytes, dense_bytes, site, unprofitable):
    """The callback an arena calls with where this tensor's values started and ended."""

    def confirm(start: int, end: int) -> None:
        fits = end <= capacity
        stored = fixed_bytes + 4 * (end - start) if fits else dense_bytes
        collector.stats.stored_bytes += stored
        if not fits:
            collector.fallbacks["arena_full"] += 1
        # An overflow says nothing about whether the site pays.
        if site is not None and fits and dense_bytes < PROFITABLE_RATIO * stored:
            unprofitable.add(site)
        handle = handle_ref()
        if handle is not None:
            handle.confirm(fits)

    return confirm


def _initial_capacity(device: torch.device, capacity) -> int:
    if isinstance(capacity, int):
        return capacity
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        if capacity == "auto":
            return CPU_AUTO_CAPACITY
        free = psutil.virtual_memory().available
    return int(free * (CUDA_AUTO_FRACTION if capacity == "auto" else capacity))
