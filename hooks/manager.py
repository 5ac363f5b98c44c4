"""The pack and unpack hooks: which saved tensors to compress, and where they go.

``Session`` holds what outlives one forward pass: an arena per device, the marked tensors,
the tables of stored tensors (to store each once, and to find a square's source), what was
learned about save sites and the statistics of the step. A step begins at the first pack
after a backward (any unpack), or after every compressed tensor of the last step was
released; the arenas are emptied then, if nothing they hold is still alive.
The hooks only call the codec API; they know nothing of the kernels' insides.
"""

from __future__ import annotations

import copy
import threading
import warnings
import weakref

import psutil
import torch

from bitsparse.allocator import Arena
from bitsparse.codecs import get_codec
from bitsparse.compressed import MAX_NUMEL, compress_into
from bitsparse.format import SUPPORTED_DTYPES, TileGeometry, dtype_spec
from bitsparse.hooks.exactness import ExactnessChecks
from bitsparse.hooks.handles import Handle, Recomputed, SquareOf, StoredTensor, ViewOf, check_version
from bitsparse.hooks.options import Options
from bitsparse.hooks.provenance import Marks, Provenance, classify_node, node_key, squared_input
from bitsparse.hooks.spans import SpanIndex
from bitsparse.hooks.stats import Stats, StepCollector

PROFITABLE_RATIO = 1.25
"""A save site whose tensors shrink less than this (dense / stored) is kept dense: the
arena's headroom (15% of what it stores) would eat most of the saving."""


def memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation of ``t``'s dims that makes it contiguous: ``()`` when ``t`` is already,
    None when no permutation does (overlapping or gapped strides)."""
    if t.is_contiguous():
        return ()
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d])))
    return order if t.permute(order).is_contiguous() else None


class Session:
    """Process-wide state behind ``compressing()`` and ``enable()``.

    Thread safety: the hooks of every thread share one session; its tables are guarded by
    one lock, and unpack may run in autograd's threads.
    """

    def __init__(self):
        self.marks = Marks()
        self._lock = threading.RLock()
        self._arenas: dict[torch.device, Arena] = {}
        self._capacities: dict[torch.device, object] = {}
        """The ``capacity`` option each arena was last sized for."""
        self._geometry = TileGeometry()
        self._live = 0
        """Compressed tensors autograd holds (their arena leases), of any step."""
        self._step = 1
        self._collector = StepCollector(1)
        self._backward_seen = False
        self._stale_arenas = False
        """Whether an arena could not be emptied at this step's start (tensors of an
        earlier step are alive), so tensors may fall back that would otherwise fit."""
        self._warned_stale = False
        self._stored = SpanIndex()
        """The step's stored tensors by span, to store a storage saved again only once."""
        # node_key(grad_fn, output_nr) -> (handle ref, shape, stride, offset, dtype): see
        # _note_source.
        self._sources: dict[tuple, tuple] = {}
        # id(saved tensor) -> slot ref: the tensors packed this step (the slot watches the
        # tensor it was made for, see Handle.watch).
        self._packed: dict[int, weakref.ref] = {}
        self._unprofitable: set = set()
        self._exact = ExactnessChecks()

    # -- hooks ------------------------------------------------------------------------------

    def pack(self, options: Options, t: torch.Tensor):
        # Runs for every saved tensor (about 400 per GPT forward, between the model's ops, where
        # the host often bounds the step), and most are skipped: decide that first, cheaply
        # (the screen reads only the tensor, the options and the marks, so needs no lock).
        reason, provenance = self._screen(t, options)
        with self._lock:
            if self._step_over():
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
                if (site := self._site(t)) in self._unprofitable:
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
            found = self._stored.find(t)
            if found is not None:
                stats.tensors_deduplicated += 1
            elif options.recompute_squares:
                found = self._recompute(t)
                if found is not None:
                    stats.tensors_recomputed += 1
            if found is None:
                sign_pack = options.sign_pack and provenance is not None
                found = slot = self._store(t, order, options, sign_pack, site)
                slot.slots += 1  # it restores t itself, whatever t's strides
            else:
                slot = self._slot(found, t)
            self._note_source(t, found)
            slot.watch(t)
            self._packed[id(t)] = weakref.ref(slot)
            return slot

    def store_compiled(self, options: Options, t: torch.Tensor, site: str) -> StoredTensor:
        """Store ``t``, which a compiled forward saves and selected at compile time (see
        ``hooks/compiled.py``), as ``pack`` stores a tensor, with one slot. The compiled code
        does not write over the memory of a buffer it freed (``hooks.compiled.steering``), so
        the handle may keep ``t``'s as eager handles do."""
        with self._lock:
            if self._step_over():
                self._begin_step()
            collector = self._collector
            collector.stats.tensors_seen += 1
            order = memory_order(t)
            if site in self._unprofitable or order is None:
                collector.skipped["unprofitable_site" if order is not None else "overlapping_or_gapped"] += 1
                return StoredTensor(None, t, None, None, None)
            self._poll()
            handle = self._store(t, order, options, options.sign_pack, site)
            handle.slots = 1
            return handle

    def unpack_compiled(self, handle: StoredTensor) -> torch.Tensor:
        """The tensor a compiled backward needs from ``handle``, bit for bit, in memory of its
        own: the backward, compiled maybe outside BitSparse's hooks, may write over what it is
        given, and a second backward needs the dense tensor again."""
        self._backward_seen = True
        with self._lock:
            self._poll()
            restored = handle.unpack()
            return restored.clone() if handle.dense is not None else restored

    def unpack(self, packed) -> torch.Tensor:
        self._backward_seen = True
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
        return (type(base.grad_fn).__name__, tuple(base.shape), t.dtype, t.device)

    # -- storing ----------------------------------------------------------------------------

    def excluded_sites(self) -> frozenset:
        """The compiled save sites learned not to pay, which compiled graphs do not select."""
        with self._lock:
            return frozenset(site for site in self._unprofitable if isinstance(site, str))

    def _arena(self, device: torch.device, options: Options) -> Arena:
        """The device's arena, resized when the options ask for another capacity (only
        while nothing it holds is alive) and set to their window."""
        arena = self._arenas.get(device)
        if arena is None:
            arena = self._arenas[device] = Arena(device, window=options.window)
        if not arena.leased:
            arena.window = options.window
            if self._capacities.get(device) != options.capacity:
                self._capacities[device] = options.capacity
                if options.capacity != "auto":
                    arena.resize(_capacity_bytes(device, options.capacity))
        return arena

    def _store(self, t: torch.Tensor, order, options: Options, sign_pack: bool, site) -> StoredTensor:
        """Compress ``t`` (permuted to ``order``, see ``memory_order``) into the device's
        arena. Where the arena has no room, ``t`` is kept dense and only measured, for the
        arena to grow for the next step; on another stream than the step's, it is kept.

        The handle keeps ``t``'s storage while it may be needed: until the arena confirms the
        values fit, or for good where they do not. A stored tensor's handle holds a lease on
        the arena until autograd releases it.
        """
        collector, stats = self._collector, self._collector.stats
        arena = self._arena(t.device, options)
        collector.arenas.add(arena)
        dense_bytes = t.numel() * t.element_size()
        if not arena.on_append_stream():
            return self._kept_dense(t, "other_stream")
        x = t.permute(order) if order else t
        spec = dtype_spec(t.dtype)
        codec = get_codec(options.backend, arena.device)
        fixed_words = self._geometry.fixed_nbytes(t.numel()) // 4
        fixed = arena.reserve_fixed(fixed_words)
        slot, report = arena.next_report(throttled=fixed is not None)
        if fixed is None:
            codec.measure(x, arena.cursor, arena.appends, spec, self._geometry, sign_pack, report)
            arena.submit(slot, _measured(collector, site, arena, fixed_words, dense_bytes), throttled=False)
            return self._kept_dense(t, "arena_full")
        compressed = compress_into(
            x,
            codec,
            self._geometry,
            arena.values,
            fixed,
            sign_pack,
            collector.nonzeros_counter(arena.device),
            report,
            arena.next_start(),
        )
        handle = StoredTensor(compressed, t, codec, _Lease(self, arena), order)
        collector.leased = True
        stats.tensors_compressed += 1
        stats.dense_bytes += dense_bytes
        collector.numel += t.numel()
        confirm = _confirmation(weakref.ref(handle), self, collector, site, arena, fixed_words, dense_bytes)
        arena.submit(slot, confirm)
        if t.is_contiguous():
            self._stored.add(t, handle)
        return handle

    def _kept_dense(self, t: torch.Tensor, reason: str) -> StoredTensor:
        """A handle keeping ``t`` as it is, a fallback for ``reason``."""
        collector = self._collector
        collector.fallbacks[reason] += 1
        collector.stats.dense_bytes += t.numel() * t.element_size()
        collector.stats.stored_bytes += t.numel() * t.element_size()
        if reason == "arena_full":
            self._warn_if_stale()
        handle = StoredTensor(None, t, None, None, None)
        if t.is_contiguous():
            self._stored.add(t, handle)
        return handle

    def _warn_if_stale(self) -> None:
        if self._stale_arenas and not self._warned_stale:
            self._warned_stale = True
            warnings.warn(
                f"BitSparse kept tensors dense because its arena is full of compressed tensors of an earlier step "
                f"that are still alive ({self._live} of them), so it could not be reused for this step. A graph is "
                "kept without its backward: an evaluation forward run with gradients enabled whose output is "
                "still referenced, or forwards and backwards interleaved (pipeline schedules, several threads "
                "training at once). Run evaluation "
                "under torch.no_grad() or drop its output; gradients stay exact either way.",
                RuntimeWarning,
                stacklevel=5,  # the user's line that saved the tensor, when a pack falls back
            )

    def _recompute(self, t: torch.Tensor) -> Handle | None:
        """A handle that restores ``t`` as the square of a tensor already handled, if it is
        one (``t`` may be a view of the square's result), with the forward's own op."""
        result = t._base if t._base is not None else t
        found = squared_input(result.grad_fn)
        if found is None or found[0][0] is None:
            return None
        edge, square = found
        source = self._sources.get(node_key(*edge))
        handle = source[0]() if source is not None else None
        if handle is None:
            return None
        _, shape, stride, offset, dtype = source
        # The square of a contiguous tensor is a new contiguous tensor of its shape and dtype
        # (under autocast, pow may return float32 of a bfloat16 input: stored instead).
        if result.shape != shape or result.dtype != dtype or result.storage_offset() != 0 or not result.is_contiguous():
            return None
        offset -= handle.start
        if (
            isinstance(handle, StoredTensor)
            and handle.compressed is not None
            and offset == 0
            and shape == handle.compressed.shape
            and self._exact.fused_square(handle.codec, dtype, result.device, square)
        ):
            recomputed = SquareOf(handle, square, result)  # decoded with its source, in one pass
        else:
            recomputed = Recomputed(ViewOf(handle, shape, stride, offset), square, result)
        self._stored.add(result, recomputed)
        return recomputed

    def _note_source(self, t: torch.Tensor, handle: Handle) -> None:
        """Note that ``handle`` restores ``t``, under ``t``'s autograd identity, for a square
        of ``t`` to find (last write wins: a tensor modified in place is packed again
        before it is squared)."""
        if t.grad_fn is not None and t.is_contiguous():
            key = node_key(t.grad_fn, t.output_nr)
            self._sources[key] = (weakref.ref(handle), t.shape, t.stride(), t.storage_offset(), t.dtype)

    @staticmethod
    def _slot(handle: Handle, t: torch.Tensor) -> Handle:
        """Count one more saved slot: ``handle`` itself, or a view of it if ``t`` is a view."""
        if not _same_geometry(handle, t):
            handle = ViewOf(handle, t.shape, t.stride(), t.storage_offset() - handle.start)
        handle.slots += 1
        return handle

    # -- life cycle -------------------------------------------------------------------------

    def poll(self) -> None:
        """Deliver the arenas' completed reports (never blocks)."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        for arena in self._arenas.values():
            arena.poll()

    def begin_step(self) -> None:
        """Begin a new step now if the current one is over (``compressing()`` entry)."""
        with self._lock:
            if self._step_over():
                self._begin_step()

    def _step_over(self) -> bool:
        """Whether the current step is over: a backward ran since it began (a pack during a
        backward, which saves for a double backward, belongs to the step), or every tensor
        it stored was released (a graph dropped without backward)."""
        if self._backward_seen:
            return torch._C._current_graph_task_id() == -1
        return self._live == 0 and self._collector.leased

    def _begin_step(self) -> None:
        """Learn from the finished step which sites do not pay and what the others need, and
        empty the arenas for the new step where nothing they hold is alive."""
        for arena in self._arenas.values():
            arena.drain()  # the last step's reports: its encoders ran before its backward
        demand = {arena: [0, 0] for arena in self._arenas.values()}
        for site, (arena, dense_bytes, fixed_words, value_words) in self._collector.sites.items():
            if dense_bytes < PROFITABLE_RATIO * 4 * (fixed_words + value_words):
                self._unprofitable.add(site)
            else:
                demand[arena][0] += fixed_words
                demand[arena][1] += value_words
        self._stale_arenas = False
        for arena, (fixed_words, value_words) in demand.items():
            self._stale_arenas |= not arena.begin_step(fixed_words, value_words)
        self._step += 1
        self._collector = StepCollector(self._step)
        self._backward_seen = False
        self._forget_saved()

    def _released(self) -> None:
        """One compressed tensor fewer (called with the lock held)."""
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
            reserved = sum(arena.reserved_bytes for arena in self._arenas.values())
            return copy.deepcopy(self._collector.finish(self._live, reserved))

    def reset(self) -> None:
        """Forget arenas (releasing their memory), learned state and statistics.

        Raises:
            RuntimeError: compressed tensors are alive (run backward, or drop their graphs).
        """
        with self._lock:
            if self._live:
                raise RuntimeError(
                    f"cannot reset BitSparse while {self._live} compressed tensors are alive: run backward "
                    "or drop the graphs that hold them first"
                )
            for arena in self._arenas.values():
                arena.drain()
            self._arenas.clear()
            self._capacities.clear()
            self._unprofitable.clear()
            self._exact.clear()
            self.marks.clear()
            self._forget_saved()
            self._step = 1
            self._collector = StepCollector(1)
            self._backward_seen = self._stale_arenas = self._warned_stale = False


def _same_geometry(handle: Handle, t: torch.Tensor) -> bool:
    """Whether ``t`` is exactly the tensor ``handle`` restores."""
    if isinstance(handle, StoredTensor):
        # Only contiguous stored tensors are shared (see _store).
        dense_shape = handle.compressed.shape if handle.compressed is not None else handle.dense[2]
        return t.storage_offset() == handle.start and t.is_contiguous() and t.shape == dense_shape
    return (t.shape, t.stride(), t.storage_offset() - handle.start) == (handle.size, handle.stride, handle.offset)


class _Lease:
    """An arena lease that also counts the session's live tensors; released when dropped,
    whatever dropped it (an exception while storing included)."""

    __slots__ = ("_session", "_lease")

    def __init__(self, session: Session, arena: Arena):
        self._session, self._lease = session, arena.open_lease()
        session._live += 1

    def __del__(self):
        with self._session._lock:
            self._lease.release()
            self._session._released()


def _confirmation(handle_ref, session: Session, collector: StepCollector, site, arena, fixed_words, dense_bytes):
    """The callback an arena calls with where a stored tensor's values started and ended."""

    def confirm(start: int, end: int) -> None:
        fits = end <= arena.values_capacity_words
        collector.stats.stored_bytes += 4 * (fixed_words + end - start) if fits else dense_bytes
        collector.add_site(site, arena, dense_bytes, fixed_words, end - start)
        if not fits:
            collector.fallbacks["arena_full"] += 1
            session._warn_if_stale()
        handle = handle_ref()
        if handle is not None:
            handle.confirm(fits)

    return confirm


def _measured(collector: StepCollector, site: tuple, arena, fixed_words: int, dense_bytes: int):
    """The callback an arena calls with where a measured tensor's values would have gone."""

    def record(start: int, end: int) -> None:
        collector.add_site(site, arena, dense_bytes, fixed_words, end - start)

    return record


def _capacity_bytes(device: torch.device, capacity: int | float) -> int:
    """An explicit capacity option in bytes (a fraction of free memory, or bytes)."""
    if isinstance(capacity, int):
        return capacity
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    return int(free * capacity)
