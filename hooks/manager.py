"""The pack and unpack hooks: which saved tensors to compress, and where they go.

``Session`` holds what outlives one forward pass: each device's arenas, the marked tensors,
the tables of stored tensors (to store each once), what was learned about save sites and
the statistics of the step. A step begins at the first pack after a backward (any unpack;
not one that saved tensors for a double backward, see ``_step_over``), or after every
compressed tensor of the last step was released; each device's pool then serves it with an
emptied arena, one that nothing alive is stored in (``bitsparse.allocator.pool``).
The hooks only call the codec API; they know nothing of the kernels' insides.
"""

from __future__ import annotations

import copy
import threading
import warnings
import weakref
from collections import defaultdict

import psutil
import torch

from bitsparse.allocator import Arena, ArenaPool, Lease
from bitsparse.codecs import get_codec
from bitsparse.format import TileGeometry
from bitsparse.hooks.exactness import ExactnessChecks
from bitsparse.hooks.handles import Derived, Handle, Recomputed, Site, SquareOf, StoredTensor, ViewOf, check_version
from bitsparse.hooks.options import Options
from bitsparse.hooks.provenance import (
    RELU_NODES,
    UNRELATED_NODES,
    Marks,
    Provenance,
    classify_node,
    product_operands,
    squared_operand,
)
from bitsparse.hooks.spans import SpanIndex, span_of
from bitsparse.hooks.stats import Stats, StepCollector

MAX_SITES = 4096
"""Save sites remembered; forgotten all at once past this (shapes that change every step)."""
PROFITABLE_RATIO = 1.25
"""A save site whose tensors shrink less than this (dense / stored) is kept dense: the
arena's headroom (15% of what it stores) would eat most of the saving."""
IDLE_STEPS_BEFORE_WARNING = 3
"""Steps without a tensor to compress (and none before) after which the session says so, once."""


class _Watch(weakref.ref):
    """A weak reference to the tensor a stored tensor's handle was made from, whose release
    its session hears of (``Session._watch_ended``); ``step`` is ``(collector, site)``."""

    __slots__ = ("step",)


class Session:
    """Process-wide state behind ``compressing()`` and ``enable()``.

    Thread safety: the hooks of every thread share one session; its tables are guarded by
    one lock, and unpack may run in autograd's threads.
    """

    def __init__(self):
        self.marks = Marks()
        self._lock = threading.RLock()
        self._pools: dict[torch.device, ArenaPool] = {}
        """Each device's arenas, one per step whose compressed tensors are alive."""
        self._arenas: list[Arena] = []
        """Every arena of every pool, for the hooks' loops (updated as pools change)."""
        self._capacities: dict[torch.device, object] = {}
        """The ``capacity`` option each device's arena was last sized for."""
        self._geometry = TileGeometry()
        self._live = 0
        """Compressed tensors autograd holds (their arena leases), of any step."""
        self._step = 1
        self._collector = StepCollector(1)
        self._backward_seen = False
        self._double_backward_task: int | None = None
        """The backward (its graph task) that saved tensors for a backward of its own, while
        it is the last one that unpacked: the forward that goes on after it (a gradient
        penalty) belongs to the same step (see ``_step_over``)."""
        self._idle_steps: int | None = 0
        """Steps whose saved tensors had none to compress, while no step has had one and the
        session has not said so (then None: ``_note_idle``)."""
        self._stored = SpanIndex()
        """The step's stored tensors by span, to store a storage saved again only once."""
        self._handles: list[tuple[weakref.ref, torch.device, int]] = []
        """The handles ``_store`` made (compressed or kept dense) and alive at the step's
        start, or made since: a reference, the device and the dense words of each. A step's
        start finds from them what the tensors released since the last one took dense."""
        # id(saved tensor) -> slot ref: the tensors packed this step (the slot watches the
        # tensor it was made for, see Handle.watch).
        self._packed: dict[int, weakref.ref] = {}
        self._unprofitable: set = set()
        self._excluded = frozenset()
        """The compiled sites among ``_unprofitable`` (see ``excluded_sites``)."""
        self._sites: dict[tuple, Site] = {}
        self._exact = ExactnessChecks()
        self._discarded_words: dict[torch.device, torch.Tensor] = {}
        """Per device, host memory the device can write, where ``_square_alone`` measures."""
        self._outgrown_words: list[torch.Tensor] = []
        """Such memory that larger memory replaced, kept: a kernel may still be writing it,
        and memory PyTorch handed out again would receive the words."""

    # -- hooks ------------------------------------------------------------------------------

    def pack_hook(self, options: Options, other):
        """The pack hook of ``options``: ``hook(t)`` returns what autograd saves for ``t``,
        ``other(t)`` for a tensor of another class than ``torch.Tensor`` or ``nn.Parameter``
        (which tracing hands over).

        It runs for every saved tensor (about 400 per GPT forward, between the model's ops,
        where the host often bounds the step), and most are kept as they are. So it first
        screens them for the commonest reasons, small, a parameter or a view of one (every
        ``Linear`` saves its weight) or made by an op the rule never selects, with the options'
        values bound here, without the lock (its counters are only this step's statistics),
        and hands every other tensor to ``pack``, which decides alike, or, when it found the
        tensor's provenance, to the step after pack's screen.
        """
        min_numel, selects_relu = options.min_numel, options.select == "relu"
        marks, plain, parameter = self.marks, torch.Tensor, torch.nn.Parameter
        pack, selected = self.pack, self._pack_selected

        def hook(t: torch.Tensor):
            cls = t.__class__
            if cls is not plain and cls is not parameter:
                return other(t)
            base = t._base
            if base is None:
                base = t
            node = base.grad_fn  # as in pack: a view holds its base's values
            numel = t.numel()
            if numel < min_numel or not numel:
                kept = "small"
            elif node is None and base.requires_grad:
                kept = "parameter"
            elif not selects_relu or marks.any:
                return pack(options, t)
            elif node is None or node.__class__ in UNRELATED_NODES:
                kept = "unrelated"
            elif node.__class__ in RELU_NODES:
                return selected(options, t, node, Provenance.RELU)
            else:
                # A cast or view, say, which the rule looks back through.
                provenance = classify_node(node)
                if provenance is not None:
                    return selected(options, t, node, provenance)
                kept = "unrelated"
            if self._backward_seen or (not self._collector.live and self._collector.leased):
                self.begin_step()
            collector = self._collector
            if kept == "small":
                collector.kept_small += 1
            elif kept == "parameter":
                collector.kept_parameters += 1
            else:
                collector.kept_unrelated += 1
            # Detached for the reason given in pack.
            return (t if node is None else t.detach()), t._version

        return hook

    def pack(self, options: Options, t: torch.Tensor):
        """What autograd saves for ``t``: ``t`` itself (with its version) when it is kept as
        it is, else a handle that restores it (see ``hooks.handles``)."""
        base = t._base
        if base is None:
            base = t
        node = base.grad_fn  # a view holds its base's values: the base's node says what they are
        numel = t.numel()
        if numel < options.min_numel or not numel:
            return self._kept(t, node, "small")
        if node is None and base.requires_grad:  # a parameter, or a view of one (weight.t())
            return self._kept(t, node, "parameter")
        cls = node.__class__
        provenance = Provenance.RELU if cls in RELU_NODES else None if cls in UNRELATED_NODES else classify_node(node)
        if provenance is not Provenance.RELU and self.marks.any and self.marks.covers(t):
            provenance = Provenance.RELU
        if provenance is None and options.select == "relu":
            return self._kept(t, node, "not_relu_family")
        return self._pack_selected(options, t, node, provenance)

    def _pack_selected(self, options: Options, t: torch.Tensor, node, provenance):
        """``pack`` for a tensor past the rule's screen (``node`` is its base's autograd node,
        ``provenance`` what ``classify_node`` says of it): stored, found stored, or kept where
        it cannot be."""
        # Not a reason of the site's (``Site.kept``): its key reads strides, which a sparse
        # tensor lacks, and a device index, which devices of other types share.
        if t.layout != torch.strided or not (t.is_cuda or t.is_cpu):
            return self._kept(t, node, "layout_or_device")
        with self._lock:
            # Within a forward that stored a tensor, neither holds: no call (host time).
            if (self._backward_seen or not self._collector.live) and self._step_over():
                self._begin_step()
            collector = self._collector
            stats = collector.stats
            # The same tensor saved again (a square's input is ReLU's output): the same slot.
            again = self._packed.get(id(t))
            slot = again() if again is not None else None
            if slot is not None and slot.watches(t):
                stats.tensors_seen += 1
                stats.tensors_deduplicated += 1
                slot.slots += 1
                return slot
            site = self._site(options, t, node, options.sign_pack and provenance is not None)
            if site.kept is not None:
                collector.skipped[site.kept] += 1
                return (t if node is None else t.detach()), t._version
            stats.tensors_seen += 1
            if collector.holds:  # confirmed tensors release their dense copy here, during the forward
                self._poll()
            contiguous = not site.order  # the site's tensors are all alike, and dense
            span = span_of(t, site.numel)
            found = self._stored.find(span)
            if found is not None:
                stats.tensors_deduplicated += 1
            elif options.recompute_squares and node.__class__ not in RELU_NODES:
                found = self._recompute(t)
                if found is not None:
                    stats.tensors_recomputed += 1
            # Each object is referred to once, for every table (host time).
            base = t._base
            if found is None:
                found = slot = self._store(options, t, site)
                saved = _Watch(t, self._watch_ended)
                saved.step = collector, site
                slot_ref = weakref.ref(slot)
                slot.slots += 1  # it restores t itself, whatever t's strides
                if contiguous:  # a later save of its storage (or a view of it) finds it
                    self._stored.add(span, slot_ref, saved if base is None else weakref.ref(base))
            else:
                slot = self._slot(found, t)
                slot_ref = weakref.ref(slot)
                saved = weakref.ref(t)
            slot.watch(saved, span[4])
            self._packed[id(t)] = slot_ref
            return slot

    def _kept(self, t: torch.Tensor, node, reason: str) -> tuple[torch.Tensor, int]:
        """What autograd saves for ``t``, of the autograd node ``node`` (its base's), kept as
        it is for ``reason``."""
        # Decided without the lock, as in pack_hook.
        if self._backward_seen or (not self._collector.live and self._collector.leased):
            self.begin_step()
        self._collector.skipped[reason] += 1  # tensors_seen counts them at the step's end
        # Kept without its history: a tensor saved by the node that made it (tanh's result)
        # would hold that node, which holds it, in a cycle that only backward breaks (Python's
        # collector cannot see it). A tensor without a node (a parameter, an input) cannot be
        # in one; nor can a parameter's view, whose node is a view's, which saves no tensor.
        # Unpacking restores the history, after checking the version (see check_version).
        if node is None or reason == "parameter":
            return t, t._version
        return t.detach(), t._version

    def store_compiled(
        self, options: Options, t: torch.Tensor, name: str, square: torch.Tensor | None = None
    ) -> StoredTensor:
        """Store ``t``, which a compiled forward saves and selected at compile time (see
        ``hooks/compiled.py``; its store op calls this, ``hooks/compiled_ops.py``) as the save
        site ``name``, as ``pack`` stores a tensor, with one slot. The compiled code may
        write over ``t``'s memory once past this call (it reuses buffers and computes in
        place), so a handle that keeps the tensor dense (held until the arena confirms its
        values, or kept where they cannot be stored) keeps a copy.

        With ``square`` (a contiguous tensor like ``t``), ``t`` is the input of a ReLU whose
        output the forward saves and squares: the handle restores that ReLU output, and
        ``square`` receives its square, whether the tensor is compressed or kept dense (the
        codecs' ``relu_square``)."""
        with self._lock:
            if self._step_over():
                self._begin_step()
            collector = self._collector
            site = self._site(options, t, name, options.sign_pack, relu_inputs=square is not None)
            if site.kept is not None:
                collector.skipped[site.kept] += 1
                self._square_alone(site, t, square)
                handle = StoredTensor(t, site)
            else:
                collector.stats.tensors_seen += 1
                if collector.holds:
                    self._poll()
                handle = self._store(options, t, site, square)
            handle.slots = 1
            if handle.dense is not None:
                handle.keep_copy()
            return handle

    def restore_compiled(self, handle: StoredTensor, out: torch.Tensor, square=None, square_grad=None) -> None:
        """Write the tensor ``handle`` restores into ``out``, a compiled backward's buffer (its
        own memory: the backward may write over it, and a second backward needs the dense
        tensor of a handle that kept it again), or with ``square`` and ``square_grad`` the
        backward of its square (``StoredTensor.restore_into``)."""
        if not self._backward_seen:
            self._backward_begins()
        self._backward_seen = True
        with self._lock:
            self._settle_for_reads()
            handle.restore_into(out, square, square_grad)

    def _backward_begins(self) -> None:
        """At the step's first unpack or restore: count, per save site, the tensors it stored
        (or measured) whose originals are still alive (``StoredTensor.outlived``). Held
        elsewhere through the forward, they were stored for nothing, and their site learns so
        at the next step (``StepCollector.demand``). Counted afresh if an exception cut a
        previous count short: the counts replace the collector's in one statement."""
        with self._lock:
            outlived = defaultdict(int)
            for slot in {ref() for ref in self._packed.values()}:
                if slot.__class__ is StoredTensor and slot.outlived():
                    outlived[slot.site] += slot.site.dense_bytes
            self._collector.outlived = outlived

    def _watch_ended(self, watch: _Watch) -> None:
        """The tensor a stored tensor's handle was made from was released. During a backward
        before its first unpack of the step, it was alive when the backward began, like the
        tensors ``_backward_begins`` counts: held past the forward by what saved it without
        these hooks (compiled code that saved it as an input, whose backward ran first), so
        storing it freed nothing. Runs in whatever thread released it, without the lock.

        A stored tensor counts as freed unless this or ``_backward_begins`` says otherwise, not
        the reverse: a callback that an exception (Ctrl-C) cuts short then leaves its site
        stored, which a later step corrects, where the reverse would keep the site dense for
        good (``StepCollector.demand`` finds it freed nothing)."""
        collector, site = watch.step
        if collector is self._collector and not self._backward_seen and torch._C._current_graph_task_id() != -1:
            collector.released_in_backward.append(site)

    def unpack_hook(self, other):
        """The unpack hook: ``hook(packed)`` restores what the pack hook returned in eager
        autograd, ``other(packed)`` anything else (what a compiled graph's pack returned while
        it was traced: the value itself, or a ``(key, size, stride)`` tuple). It runs for
        every saved tensor backward uses, so eager values go straight to ``unpack``."""
        unpack, handle = self.unpack, Handle

        def hook(packed):
            if (packed.__class__ is tuple and len(packed) == 2) or isinstance(packed, handle):
                return unpack(packed)
            return other(packed)

        return hook

    def unpack(self, packed) -> torch.Tensor:
        """What autograd gets back for ``packed``, which the pack hook returned in eager
        autograd: the tensor kept as it is, or restored by its handle.

        Raises:
            RuntimeError: the saved tensor was modified in place since it was saved.
        """
        if not self._backward_seen:
            self._backward_begins()
        self._backward_seen = True
        if self._double_backward_task is not None and torch._C._current_graph_task_id() != self._double_backward_task:
            self._double_backward_task = None  # another backward ran since
        if packed.__class__ is tuple:  # a tensor kept as it is, and its version
            kept, version = packed
            if kept._version != version:
                check_version(kept, version)
            return kept
        with self._lock:
            self._settle_for_reads()
            return packed.unpack()

    # -- decisions --------------------------------------------------------------------------

    def _site(self, options: Options, t: torch.Tensor, producer, sign_pack: bool, relu_inputs: bool = False) -> Site:
        """The save site of ``t``, whose producer is the autograd node ``producer`` (or the
        name a compiled graph gives the site, which may give it the inputs of a ReLU: see
        ``Site``)."""
        shape, device = t.shape, t.get_device()  # the device's index (-1: the CPU) costs less host time
        if isinstance(producer, str):
            key = (producer, shape, t.stride(), t.dtype, device, options.backend, sign_pack, relu_inputs)
        else:
            # All views of one tensor share their site's name.
            base = t._base
            base_shape = shape if base is None else base.shape
            key = (producer.__class__, base_shape, shape, t.stride(), t.dtype, device, options.backend, sign_pack)
        site = self._sites.get(key)
        if site is None:
            if len(self._sites) >= MAX_SITES:  # shapes that change at every step
                self._sites.clear()
            name = (
                producer if isinstance(producer, str) else (type(producer).__name__, tuple(key[1]), t.dtype, t.device)
            )
            codec = get_codec(options.backend, t.device)
            site = self._sites[key] = Site(name, t, codec, sign_pack, self._geometry, relu_inputs)
            site.learn(name in self._unprofitable)
        return site

    # -- storing ----------------------------------------------------------------------------

    def excluded_sites(self) -> frozenset:
        """The compiled save sites learned not to pay, which compiled graphs do not select."""
        return self._excluded

    def _site_arena(self, site: Site, options: Options) -> Arena:
        """``_arena`` for ``site``'s device, kept on the site with the ``options`` it is for
        (``Options`` are made once per set of values: see ``bitsparse.training``)."""
        site.arena, site.arena_options = self._arena(site.device, options), options
        return site.arena

    def _arena(self, device: torch.device, options: Options) -> Arena:
        """The arena that serves the device's step, resized when the options ask for another
        capacity (only while nothing it holds is alive) and set to their window and spill."""
        pool = self._pools.get(device)
        if pool is None:
            pool = ArenaPool(device)
            # One statement, which an exception (Ctrl-C) cannot cut: the list and the pools agree.
            self._pools[device], self._arenas = pool, self._arenas + pool.arenas
        arena = pool.current
        if not arena.leased:
            pool.configure(options.window, options.host_spill)
            if self._capacities.get(device) != options.capacity:
                if options.capacity != "auto":
                    self._forget_buffers()
                    _resize(arena, device, options.capacity)
                self._capacities[device] = options.capacity  # only once applied: a failed one is tried again
        return arena

    def _store(self, options: Options, t: torch.Tensor, site: Site, square: torch.Tensor | None = None) -> StoredTensor:
        """Compress ``t``, of ``site``, into the device's arena (with ``square``, as
        ``store_compiled`` says). Where the arena has no room, ``t`` is kept dense and only
        measured, for the arena to grow for the next step; on another stream than the step's,
        it is kept.

        The handle keeps ``t``'s storage while it may be needed: where the arena is not sure
        that the values fit, until it confirms they do, or for good where they do not. A
        stored tensor's handle holds a lease on the arena until autograd releases it. Every
        handle it returns is tracked in ``_handles``.
        """
        handle = self._store_or_keep(options, t, site, square)
        self._handles.append((weakref.ref(handle), site.device, site.dense_words))
        return handle

    def _store_or_keep(
        self, options: Options, t: torch.Tensor, site: Site, square: torch.Tensor | None
    ) -> StoredTensor:
        """``_store``'s handle, which the caller tracks."""
        collector = self._collector
        arena = site.arena if site.arena_options is options else self._site_arena(site, options)
        if not arena.on_append_stream():
            self._square_alone(site, t, square)
            return self._kept_dense(t, site, "other_stream")
        x = site.in_memory_order(t)
        if square is not None:
            square = site.in_memory_order(square)
        values = arena.values
        fixed = arena.reserve_fixed(site.fixed_words)
        if fixed is None:
            if values is not None and arena.values is None:  # it let its buffer go: no site may keep it alive
                self._forget_stale_buffers()
            self._measure(arena, site, x, square)
            return self._kept_dense(t, site, "out_of_memory" if arena.out_of_memory else "arena_full")
        slot, report, sure = arena.next_report(site.max_value_words, site.dense_words)
        if site.values is not arena.values:
            site.prepare(arena.values, self._geometry, report is not None)
        base = arena.next_start()
        site.encode(x, fixed, base, collector.nonzeros_counter(arena), report, square)
        handle = StoredTensor(t, site, fixed, base, _Lease(self, arena, site.dense_words), held=not sure)
        # A held tensor's dense copy goes when the arena confirms that its values fit.
        if not sure:
            collector.holds = True
        number = arena.submit(slot, None if sure else _confirmation(weakref.ref(handle), arena))
        collector.appends.append((arena, number, site, True))
        if sure and arena.stream is not None:
            # t's memory may return to the caching allocator before the encoder has read it:
            # memory of another stream is then handed out only after the encoder.
            t.record_stream(arena.stream)
        collector.leased = True
        return handle

    def _measure(self, arena: Arena, site: Site, x: torch.Tensor, square: torch.Tensor | None) -> None:
        """Measure ``x`` (and write ``square``, as ``_store`` says) for the arena to grow for
        the next step: on the device, on its cursor, where it has a buffer; else in host
        memory, so that an arena without one (a first step's) still holds no device memory."""
        spec, geometry = site.spec, self._geometry
        if arena.cursor is None:
            tile_words = arena.next_measure(geometry.num_tiles(site.numel))
            site.codec.measure_tiles(x, tile_words, spec, geometry, site.sign_pack, square)
            number = arena.submit_measure(tile_words)
        else:
            slot, report, _ = arena.next_report(site.max_value_words, 0)
            site.codec.measure(x, arena.cursor, arena.appends, spec, geometry, site.sign_pack, report, square)
            number = arena.submit(slot)
        self._collector.appends.append((arena, number, site, False))

    def _kept_dense(self, t: torch.Tensor, site: Site, reason: str) -> StoredTensor:
        """A handle keeping ``t`` as it is, a fallback for ``reason``."""
        collector = self._collector
        collector.fallbacks[reason] += 1
        collector.stats.dense_bytes += site.dense_bytes
        collector.stats.stored_bytes += site.dense_bytes
        return StoredTensor(t, site)

    def _square_alone(self, site: Site, t: torch.Tensor, square: torch.Tensor | None) -> None:
        """Write ``square`` (if any) for ``t``, kept as it is, as storing it would have: the
        codec measures ``t`` per tile into host memory that nobody reads, which touches no
        arena and takes no device memory."""
        if square is not None:
            tiles = self._geometry.num_tiles(site.numel)
            discarded = self._discarded_words.get(t.device)
            if discarded is None or discarded.numel() < tiles:
                if discarded is not None:
                    self._outgrown_words.append(discarded)
                discarded = torch.empty(2 * tiles, dtype=torch.int32, pin_memory=t.is_cuda)
                self._discarded_words[t.device] = discarded
            x, square = site.in_memory_order(t), site.in_memory_order(square)
            site.codec.measure_tiles(x, discarded[:tiles], site.spec, self._geometry, site.sign_pack, square)

    def _recompute(self, t: torch.Tensor) -> Handle | None:
        """A handle that restores ``t`` as the square of a stored tensor (``t`` may be a view
        of the square's result), with the forward's own op. The source is what the square's
        own node saved of its input: the handle this session returned for the very values the
        forward squared (a tensor modified in place since is packed again), never one found
        by the input's identity, whose values may have changed before the square (under
        ``torch.no_grad()``, say, where the square's node saved them without these hooks)."""
        result = t._base if t._base is not None else t
        squared = squared_operand(result.grad_fn)
        if squared is None:
            return self._recompute_product(result)
        source, square = squared
        view = _stored_view(source)
        if view is None:  # kept as it is, or saved without these hooks
            return None
        stored, shape = view.source, view.size
        # The square of a contiguous tensor is a new contiguous tensor of its shape and dtype
        # (under autocast, pow may return float32 of a bfloat16 input: stored instead).
        dtype = stored.site.dtype
        if result.shape != shape or result.dtype != dtype or result.storage_offset() != 0 or not result.is_contiguous():
            return None
        if (
            source is stored
            and stored.fixed is not None
            and shape == stored.site.stored_shape
            and self._exact.fused_square(stored.site.codec, dtype, result.device, square)
        ):
            recomputed = SquareOf(stored, square, result)  # decoded with its source, in one pass
        else:
            recomputed = Recomputed((view,), square, result)
        self._stored.add(span_of(result), weakref.ref(recomputed), weakref.ref(result))
        return recomputed

    def _recompute_product(self, result: torch.Tensor) -> Handle | None:
        """A handle that restores ``result``, a product of two tensors of its geometry and
        dtype (a ReGLU's ``relu(g) * u``), one of them stored or recomputed itself (a
        ReLU²-GLU's ``relu(g) ** 2``), with ``torch.mul`` from what the product's node saved
        of them, as ``_recompute`` restores a square; None where the node did not save both
        (a factor without gradient) or they are not such tensors."""
        operands = product_operands(result.grad_fn)
        if operands is None or result.storage_offset() != 0:
            return None
        like = (result.shape, result.stride(), result.dtype)
        sources = []
        for packed in operands:
            if packed.__class__ is tuple:  # kept as it is, with its version
                kept = packed[0]
                geometry, source = (kept.shape, kept.stride(), kept.dtype), packed
            elif isinstance(packed, Derived):  # recomputed itself (a ReLU²-GLU's square)
                geometry, source = (packed.size, packed.stride, packed.dtype), packed
            else:
                source = _stored_view(packed)
                if source is None:  # saved without these hooks
                    return None
                geometry = (source.size, source.stride, source.source.site.dtype)
            if geometry != like:
                return None
            sources.append(source)
        if all(source.__class__ is tuple for source in sources):
            return None  # nothing stored to recompute from: stored itself
        recomputed = Recomputed(tuple(sources), torch.mul, result)
        self._stored.add(span_of(result), weakref.ref(recomputed), weakref.ref(result))
        return recomputed

    @staticmethod
    def _slot(handle: Handle, t: torch.Tensor) -> Handle:
        """Count one more saved slot: ``handle`` itself, or a view of it if ``t`` is a view."""
        if not _same_geometry(handle, t):
            handle = ViewOf(handle, t.shape, t.stride(), t.storage_offset() - handle.start)
        handle.slots += 1
        return handle

    # -- life cycle -------------------------------------------------------------------------

    def poll(self) -> None:
        """Deliver the arenas' reports that held tensors wait for, as far as they arrived
        (never blocks): their dense copies go."""
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        """``poll`` with the lock held. The reports of tensors sure to fit wait for the backward
        (``_settle_for_reads``): the forward spends no time on them."""
        for arena in self._arenas:
            arena.poll(awaited_only=True)

    def _settle_for_reads(self) -> None:
        """Deliver the arenas' reports, and make what they hold safe to decode on the current
        stream (a tensor sure to fit may be unpacked before its encoder ran). The backward
        takes the reports that the forward left, so that the next step's start has few."""
        for arena in self._arenas:
            arena.poll()
            arena.order_reads()

    def begin_step(self) -> None:
        """Begin a new step now if the current one is over."""
        with self._lock:
            if self._step_over():
                self._begin_step()

    def _step_over(self) -> bool:
        """Whether the current step is over: a backward ran since it began, or every tensor
        it stored was released (a graph dropped without backward).

        A pack during a backward, which saves for a double backward, belongs to the step, and
        so does the forward that goes on after such a backward while the step's tensors are
        alive: a gradient penalty (``torch.autograd.grad(..., create_graph=True)``, then more
        forward, then the backward of it all) is one step, whose arena holds all of it, unless
        everything the step stored was released."""
        if self._backward_seen:
            task = torch._C._current_graph_task_id()
            if task != -1:
                self._double_backward_task = task
                return False
            if self._double_backward_task is not None and (self._live or not self._collector.leased):
                self._backward_seen = False
                return False
            return True
        return self._collector.live == 0 and self._collector.leased

    def _begin_step(self) -> None:
        """Learn from the finished step which sites do not pay and what the others need, and
        give the new step an emptied arena on each device (see ``_serve_new_step``)."""
        finished = self._collector
        self._recount()
        self._list_arenas()  # again, in case an exception (Ctrl-C) cut the last step's start short
        for arena in self._arenas:
            arena.drain()  # the last step's reports: its encoders ran before its backward
        # An arena that no tensor of the step reached (a forward that saved nothing it would
        # store, or steps of several threads interleaved) keeps its size.
        demand = dict.fromkeys(self._arenas, (None, None, 0, 0))
        by_name: dict = {}  # several Site objects may share a name (strides, options)
        for site, (arena, dense_bytes, fixed_words, value_words, most_words) in self._collector.demand().items():
            totals = by_name.setdefault(site.name, [arena, 0, 0, 0, 0])
            totals[1] += dense_bytes
            totals[2] += fixed_words
            totals[3] += value_words
            totals[4] += most_words
        learned = False
        for name, (arena, dense_bytes, fixed_words, value_words, most_words) in by_name.items():
            if demand[arena][0] is None:
                demand[arena] = (0, 0, 0, 0)
            if dense_bytes < PROFITABLE_RATIO * 4 * (fixed_words + value_words):
                self._unprofitable.add(name)
                learned = True
                if isinstance(name, str):
                    self._excluded |= {name}
            else:
                fixed, values, dense, most = demand[arena]
                demand[arena] = (fixed + fixed_words, values + value_words, dense + dense_bytes // 4, most + most_words)
        if learned:
            for site in self._sites.values():
                site.learn(site.name in self._unprofitable)
        self._serve_new_step(demand)
        self._step += 1
        self._collector = StepCollector(self._step)
        self._backward_seen = False
        self._double_backward_task = None
        self._forget_saved()
        self._note_idle(finished)  # last: a warning made an error leaves the step begun

    def _serve_new_step(self, demand: dict) -> None:
        """Begin each device's step in its pool with the finished step's ``demand`` (per
        arena). Where tensors stored in an earlier step are still alive (forwards and
        backwards interleaved, as in pipeline schedules, or a graph kept without backward),
        the new step is expected to take what the tensors released since the last step began
        took dense (a microbatch's forward after a microbatch's backward): its arena is
        planned within that, less what the arenas of the live tensors hold beyond them, so
        that no step holds more than it would without BitSparse. Otherwise the arena plans
        from the steps it served alone."""
        handles, freed, alive = [], defaultdict(int), set()
        for entry in self._handles:
            if entry[0]() is None:
                freed[entry[1]] += entry[2]
            else:
                handles.append(entry)
                alive.add(entry[1])
        self._handles = handles
        for device, pool in self._pools.items():
            expected = freed[device] if device in alive else None
            pool.begin_step(demand[pool.current], expected)
        self._list_arenas()
        self._forget_stale_buffers()

    def _note_idle(self, collector: StepCollector) -> None:
        """Warn, once, after ``IDLE_STEPS_BEFORE_WARNING`` steps whose saved tensors had none
        to compress, while no step has had one (a model without ReLU-family activations):
        there the hooks only cost host time, for every saved tensor. A model with tensors to
        compress, which its sites may have learned not to pay, is not warned about."""
        if self._idle_steps is None or collector.found_candidate():
            self._idle_steps = None
            return
        steps = self._idle_steps + (collector.screened_out() > 0)
        # None before warning: a warning made an error is not raised again at every step.
        self._idle_steps = steps if steps < IDLE_STEPS_BEFORE_WARNING else None
        if steps >= IDLE_STEPS_BEFORE_WARNING:
            warnings.warn(
                f"BitSparse compressed nothing in the last {steps} steps: none of the tensors they "
                "saved for backward (of min_numel elements or more) is ReLU-family (the output of relu, relu6, "
                "or hardtanh, clamp or threshold with a nonnegative floor, a square, dropout or product of one, "
                "or a tensor passed to bitsparse.mark), and checking each saved tensor only costs host time. "
                "Leave compressing() and enable() out for this model, mark the tensors to compress with "
                "bitsparse.mark(), or pass select='all' to try every floating tensor.",
                RuntimeWarning,
                stacklevel=5,
            )

    def _list_arenas(self) -> None:
        """List every arena of every pool again (``_arenas``)."""
        self._arenas = [arena for pool in self._pools.values() for arena in pool.arenas]

    def _forget_stale_buffers(self) -> None:
        """Let the sites forget an arena that no longer serves the steps, or a buffer their
        arena let go of: they must not keep a released buffer alive, nor store into an old
        arena. Checked at each step's start, not told by the pools, so that a start that an
        exception (Ctrl-C) cut short, after a pool switched arenas, leaves no site behind
        when it runs again."""
        current = [pool.current for pool in self._pools.values()]
        for site in self._sites.values():
            arena = site.arena
            if arena is not None and (all(arena is not c for c in current) or site.values is not arena.values):
                site.forget_buffer()

    def _forget_buffers(self) -> None:
        """Let the sites' prepared codecs and arenas go: an arena may change its buffer now,
        or another arena serve the steps."""
        for site in self._sites.values():
            site.forget_buffer()

    def _recount(self) -> None:
        """Count the live tensors again from the arenas' leases, the truth, in case an
        exception (Ctrl-C) cut an update of the count short."""
        self._live = sum(pool.open_leases for pool in self._pools.values())

    def _released(self, step: StepCollector) -> None:
        """One compressed tensor of ``step`` fewer (called with the lock held)."""
        self._live, step.live = self._live - 1, step.live - 1  # one statement: nothing cuts it
        if self._live == 0:
            self._forget_saved()
            self.marks.clear()

    def _forget_saved(self) -> None:
        """Drop the lookups of what this step saved (they refer to its tensors and handles)."""
        self._stored.clear()
        self._packed.clear()

    def stats(self) -> Stats:
        with self._lock:
            reserved = sum(pool.reserved_bytes for pool in self._pools.values())
            spill = sum(pool.spill_bytes for pool in self._pools.values())
            return copy.deepcopy(self._collector.finish(self._live, reserved, spill))

    def reset(self) -> None:
        """Forget arenas (releasing their memory), learned state and statistics.

        Raises:
            RuntimeError: compressed tensors are alive (run backward, or drop their graphs).
        """
        with self._lock:
            self._recount()
            if self._live:
                raise RuntimeError(
                    f"cannot reset BitSparse while {self._live} compressed tensors are alive: run backward "
                    "or drop the graphs that hold them first"
                )
            for arena in self._arenas:
                arena.drain()
            self._pools.clear()
            self._arenas, self._handles = [], []
            self._capacities.clear()
            self._sites.clear()
            self._unprofitable.clear()
            self._excluded = frozenset()
            self._exact.clear()
            self.marks.clear()
            self._forget_saved()
            self._step = 1
            self._collector = StepCollector(1)
            self._backward_seen = False
            self._idle_steps = 0
            self._double_backward_task = None


def _stored_view(packed) -> ViewOf | None:
    """``packed``, what a node saved of a tensor it computes from, as a view of a stored
    tensor to recompute from (through a view, the stored tensor decodes once per backward for
    all its slots); None if it is no handle of a stored tensor."""
    if packed.__class__ is StoredTensor:
        site = packed.site
        return ViewOf(packed, site.shape, site.stride, 0)
    if packed.__class__ is ViewOf and packed.source.__class__ is StoredTensor:
        return packed
    return None


def _same_geometry(handle: Handle, t: torch.Tensor) -> bool:
    """Whether ``t`` is exactly the tensor ``handle`` restores."""
    if isinstance(handle, StoredTensor):
        # Only contiguous stored tensors are shared (see _store).
        return t.storage_offset() == handle.start and t.is_contiguous() and t.shape == handle.site.shape
    return (t.shape, t.stride(), t.storage_offset() - handle.start) == (handle.size, handle.stride, handle.offset)


class _Lease(Lease):
    """An arena lease that also counts the session's live tensors, and those of the step that
    stored them; released when dropped, whatever dropped it (an exception while storing
    included). The counts are for the hooks' quick checks; each step's start counts the
    session's again from the arenas' leases, which an exception cannot leave wrong (see
    ``Lease``). A step's own count that one left too high only keeps the step going until its
    backward, as though its tensors were alive."""

    __slots__ = ("_session", "_step")

    def __init__(self, session: Session, arena: Arena, words: int):
        super().__init__(arena, words)
        step = session._collector
        # One statement: nothing cuts it.
        self._session, self._step, session._live, step.live = session, step, session._live + 1, step.live + 1

    def __del__(self):
        session = getattr(self, "_session", None)  # None if an exception cut __init__ short
        if session is not None:
            with session._lock:
                self.release()
                session._released(self._step)


def _confirmation(handle_ref, arena: Arena):
    """The callback an arena calls with where a held tensor's values started and ended: the
    handle lets its dense copy go if they fit, and keeps it for good if not (a fallback,
    which the step's accounting counts)."""

    def confirm(start: int, end: int) -> None:
        fits = end <= arena.values_capacity_words
        handle = handle_ref()
        if handle is not None:
            handle.confirm(fits)

    return confirm


def _resize(arena: Arena, device: torch.device, capacity: int | float) -> None:
    """Give ``arena`` the buffer an explicit ``capacity`` option asks for.

    Raises:
        torch.OutOfMemoryError: the device has no room for it; says what to pass instead.
    """
    capacity_bytes = _capacity_bytes(device, capacity)
    try:
        arena.resize(capacity_bytes)
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(
            f"BitSparse could not allocate the arena that capacity={capacity!r} asks for ({capacity_bytes} bytes "
            f"on {device}): pass a smaller capacity, a fraction of free memory (capacity=0.1, say), or "
            "capacity='auto', which sizes the arena from what the steps store."
        ) from error


def _capacity_bytes(device: torch.device, capacity: int | float) -> int:
    """An explicit capacity option in bytes (a fraction of free memory, or bytes)."""
    if isinstance(capacity, int):
        return capacity
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    return int(free * capacity)
