"""The arena: one buffer per device for compressed tensors, handed out without waiting for the GPU.

The buffer is a run of int32 words in two regions:

* the *fixed* region holds parts whose size the host knows from a tensor's shape (bitmasks,
  tile words). They are handed out at host-known positions by a host-side bump pointer;
* the *value* region receives value streams, appended on the device: kernels advance a
  device-side cursor (see ``bitsparse.ValueBuffer``), so the host never learns sizes in time.

Each append also gets a *start word* (``next_start``), an int64 device word in which its
encoder records where its values begin.

The host learns how far the value cursor went asynchronously: each append on CUDA gets a
*report slot* (``next_report``), a word of pinned host memory that its encoder sets to the
end of the append plus one when it finishes. Reports are read in order, with no CUDA call:
``poll`` (never blocking) delivers those that have arrived when some caller waits for one (a
callback given to ``submit``, or memory held for a throttled append) or all that have,
``drain`` delivers all, and ``ends`` lists where each append ended. An append sure to fit
needs nothing delivered before the step's end, so the forward, where the host often sets
the pace, need not spend time on its report.

The host also knows how far the cursor can be at most: where the last report put it, plus
the most that every unreported append can take (its caller says how much, from the shape).
An append within that bound is *sure* to fit, and its caller needs to hold nothing until it
is confirmed. The others are *throttled*: their callers hold memory until their reports come
(a dense copy of what they store). At most ``window`` of them (any number where the window
is None) stay unconfirmed, and beyond the first only while the memory they hold stays within
the step's *hold allowance*: what the step's tensors take dense, as the last step's demand
says, less the arena's own size. One more waits for the oldest reports first. A wait only
happens when the host runs that far ahead of the GPU, so it throttles the host, and the GPU
idles for it only if the host had no lead left.

Why the allowance: a step's stored tensors are all alive at its end (the end of a forward,
where a training step peaks), and the arena and the held copies together take no more than
those tensors would dense, however wide the window.

With ``spill``, the value region goes on in pinned host memory (``bitsparse.allocator.
mapped``): the device part is sized for what recent steps stored, the host part for the
most that their tensors could take beyond it. Appends are then sure to fit however
far the host runs ahead, so nothing is held or waited for; values that outrun the device
part are written to the host part over the bus and read back from there in backward, and
the next step's device part grows to take them.

An append that did not fit (or that was only measured: see ``Codec.measure``) still moves
the cursor, so the cursor's last position is what the step would have needed.

The cursor, the encoders' scratch words and the start words come and go with the buffer:
an arena without one holds no device memory at all. It measures in host memory instead
(``next_measure``): the device writes each tile's words there, and ``drain`` adds them up
once they have all arrived.

Leases tie the arena's contents to their users: while any lease is open, ``begin_step``
keeps them (and only notes the step's demand); a step that begins then is served by another
arena (``bitsparse.allocator.pool``). Otherwise it sizes both regions to the most that any of
the last ``DEMAND_STEPS`` steps it served needed (plus headroom), so that steps of different
sizes in turn (a longer batch every other step, two models trained by turns) each find room,
and empties them. The device part never exceeds what the stored tensors of the smallest of
those steps take dense, nor a budget its caller gives: a step like any of them then holds
less with the arena than it would hold without it. The arena starts empty unless given a
capacity: a first step only measures (in host memory), and the next one has room for what
the first needed. A buffer is allocated at a step's first ``reserve_fixed``; where the device
has no room for it, that step goes on measuring as a first step does, and later plans take at
most half of it.

The arena knows nothing of autograd or of the format: it hands out words.
"""

from __future__ import annotations

import collections
import math
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import psutil
import torch

from bitsparse.allocator.mapped import device_then_host, granularity
from bitsparse.compressed import ValueBuffer

WORD_BYTES = 4
GROW_WHEN_ABOVE = 0.9
"""A region is grown when a step used more than this fraction of it."""
HEADROOM = 1.15
"""A resized region is this much larger than the step's demand."""
DEMAND_STEPS = 8
"""A region is sized for the most that any of this many recent steps asked of it."""
SPILL_SHARE_OF_HOST = 0.25
"""The most of the host's available memory the spill regions of its devices take together
(they are pinned): each takes this divided by the number of visible devices."""
ALIGN_WORDS = 32
"""The value region starts this many words (128 bytes) into the buffer, or a multiple."""
REPORT_TIMEOUT_S = 1.0
"""How long a wait spins on a report slot before it synchronizes the device instead."""
START_SLOTS = 64
"""Start words made when the first is asked for; more are made between steps as needed."""
REPORT_SLOTS = 64
"""Report slots made at a time (pinned host memory), when every slot is in use."""
COUNTER_WORDS = 4
"""The int64 device words made with a buffer: the cursor, the encoders' two scratch words
and the tally."""
ALLOCATOR_BLOCK = 512
"""Bytes PyTorch's caching allocator rounds each device allocation up to a multiple of."""
MAX_CACHED_VIEWS = 4096
"""Fixed-region views kept for reuse; the cache is emptied when it grows past this."""


@dataclass
class ArenaUsage:
    """What the arena holds and what was asked of it since it was last emptied, in bytes."""

    capacity: int
    """The buffer's device memory: both regions (the value region's device part)."""
    reserved: int
    """All the device memory the arena holds: the buffer, its start words and counters."""
    values_capacity: int
    """The value region's device part."""
    spill_capacity: int
    """The value region's host part (pinned host memory)."""
    spilled: int
    """Values appended to the host part."""
    fixed_used: int
    fixed_demand: int
    values_demand: int
    window_waits: int

    @property
    def peak(self) -> int:
        """Bytes in use (their peak, since nothing is freed before the arena is emptied)."""
        return self.fixed_used + min(self.values_demand, self.values_capacity)


class Lease:
    """A claim on the arena's contents, opened by making it (``Arena.open_lease``); release
    it when they are not needed, or drop it. ``words`` is what its holder would take without
    the arena (the dense size of what it stores), for ``Arena.excess_words``; 0 once it keeps
    that dense anyway (what it stored did not fit). A subclass may add what its owner counts.

    The arena knows its leases by weak reference, not by a count: a count that an exception
    cut between two updates (Ctrl-C, anywhere) would be wrong for good, and a lease the
    arena missed would let it reuse memory that a compressed tensor still needs."""

    __slots__ = ("_arena", "words", "__weakref__")

    def __init__(self, arena: "Arena", words: int = 0):
        self._arena, self.words = arena, words
        arena._lease_refs.append(weakref.ref(self))

    def release(self) -> None:
        self._arena = None

    @property
    def is_open(self) -> bool:
        return self._arena is not None


class Arena:
    """One device buffer for the compressed tensors of a training step.

    Args:
        device: the device of the buffer.
        capacity_bytes: initial size of the buffer (0: none until a step asks for room).
        fixed_fraction: share of an explicit capacity for the fixed region.
        window: most throttled appends whose end the host has not confirmed yet; None: as
            many as the hold allowance lets.
        growable: resize the regions between steps to fit recent steps' demand.
        asynchronous: whether appends report their ends through report slots for a later
            ``poll`` (None: on CUDA, where reading the cursor would wait for the GPU; on the
            CPU, a codec that writes the slots exercises the same path, for tests).
        spill: continue the value region in pinned host memory, sized between steps (see
            above); only for asynchronous arenas, and on CUDA where the driver can map host
            memory into a device range (``mapped.granularity``).

    Raises:
        ValueError: a negative capacity, a fraction outside (0, 1) or a window below 1.
    """

    _cpu_mapping_words = 1
    """The unit of a spilling CPU arena's parts (it simulates a device's; tests raise it to
    play CUDA's mapping granularity)."""

    def __init__(
        self,
        device: torch.device | str,
        capacity_bytes: int = 0,
        *,
        fixed_fraction: float = 0.25,
        window: int | None = 1,
        growable: bool = True,
        asynchronous: bool | None = None,
        spill: bool = False,
    ):
        if not 0 < fixed_fraction < 1:
            raise ValueError(f"fixed_fraction must be between 0 and 1, got {fixed_fraction}")
        if window is not None and window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"  # read at every append: a bool, not the device's str
        self.window = window
        self.growable = growable
        self.fixed_fraction = fixed_fraction
        if self._cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._device_index = self.device.index if self._cuda else -1
        self._buffer: torch.Tensor | None = None
        self.cursor: torch.Tensor | None = None
        """The value cursor, a device word made with the buffer (None without one)."""
        self.appends: torch.Tensor | None = None
        """The encoders' two scratch words (see ValueBuffer), beside the cursor."""
        self.tally: torch.Tensor | None = None
        """A device word beside the cursor for the arena's users to count into (an int64
        ``[1]``), kept as long as the buffer."""
        self.values: ValueBuffer | None = None
        self._planned: tuple[int, int, int] | None = None
        """Region sizes (fixed, value, spill words) to allocate at the next ``reserve_fixed``."""
        self._lease_refs: list[weakref.ref] = []
        """The leases opened since they were last counted (``open_leases``), by weak reference."""
        self._start_slots: tuple = ()
        self._wanted_start_slots = START_SLOTS
        """Start words to make with the next buffer: as many as the last step's appends, plus headroom."""
        self._expected_dense_words = 0
        """What the step's tensors are expected to take dense (see ``begin_step``)."""
        self._demands: collections.deque = collections.deque(maxlen=DEMAND_STEPS)
        """(fixed, value, most value) words each recent step that stored anything asked for,
        and the dense words of its tensors (None: not known), newest last."""
        self._asynchronous = self._cuda if asynchronous is None else asynchronous
        self.spill = spill
        self._spill_refused = False
        """Whether mapping a spill region failed (no room, or a driver that refuses)."""
        self._room_words: int | None = None
        """The most device words a plan's regions may take, once the device had no room for
        a planned buffer: half of that buffer's, halved again at each refusal (None: no
        limit)."""
        self._report_slots: list[torch.Tensor] = []
        self._report_ends: list = []  # NumPy views of the slots, read without a CUDA call
        self._free_reports: list[int] = []
        # Per slot: the most words its append can take, the words its caller holds when
        # next_report throttled it (0 when not), and whether it was sure to fit.
        self._claims: list[tuple[int, int, bool]] = []
        self._pending: collections.deque = collections.deque()
        """(slot, callback or None) of the submitted appends not delivered yet, in order."""
        self._measured: collections.deque = collections.deque()
        """The tile words (NumPy views) of the appends measured in host memory and not
        delivered yet, in order. ``drain`` delivers them, before any report: an arena
        measures so only while it has no buffer, and drains before it makes one."""
        self._measuring: dict[int, torch.Tensor] = {}
        """Tile words handed out by ``next_measure`` and not submitted, by id."""
        self._empty()
        self.resize(capacity_bytes)

    # -- layout -------------------------------------------------------------------------

    def resize(self, capacity_bytes: int) -> None:
        """Make the buffer ``capacity_bytes`` (split by ``fixed_fraction``), empty. Only
        while no lease is open.

        Raises:
            ValueError: a negative capacity. RuntimeError: a lease is open.
        """
        if capacity_bytes < 0:
            raise ValueError(f"arena capacity must be >= 0 bytes, got {capacity_bytes}")
        words = capacity_bytes // WORD_BYTES
        fixed = max(1, int(words * self.fixed_fraction)) if words >= 3 else 0
        # The value region starts aligned and ends with the guard word, all within the capacity.
        self._allocate(fixed, max(0, words - _aligned(fixed) - 1))

    @property
    def spills(self) -> bool:
        """Whether the arena continues its value region in host memory (see ``spill``)."""
        if not self.spill or not self._asynchronous or self._spill_refused:
            return False
        return not self._cuda or granularity(self._device_index) is not None

    def _allocate(self, fixed_words: int, value_words: int, spill_words: int = 0) -> None:
        """A new buffer: ``fixed_words``, then from the next multiple of ``ALIGN_WORDS``
        ``value_words`` of device memory and ``spill_words`` of host memory for values (both
        parts rounded up to the mapping's granularity), and the guard (see ValueBuffer); none
        when ``fixed_words`` is 0. Without a spill region when it cannot be mapped (with a
        warning). The old buffer is released first."""
        if self.leased:
            raise RuntimeError("the arena cannot be resized while its contents are leased")
        # The step's measured appends end where the old cursor says, which the new one continues.
        self.drain()
        # Closed first (no fixed words: nothing is handed out of the buffer) and opened last,
        # each in one statement, which an exception (Ctrl-C) cannot cut: an arena it cut short
        # stays closed, and asks for a buffer at the next step.
        self._fixed_capacity, self._requested = 0, (0, 0, 0)
        # Nothing may keep the old buffer alive while the new one is allocated.
        self.values = self._buffer = self._planned = None
        self.cursor = self.appends = self.tally = None
        self._start_slots = ()
        self._fixed_views: dict[tuple[int, int], torch.Tensor] = {}
        # Read at every append: ints, not properties.
        self._values_capacity = self._device_value_words = self._spill_words = 0
        requested = (fixed_words, value_words, spill_words)  # before rounding: what plans compare
        if fixed_words == 0:
            self._requested = requested
            self._update_hold_allowance()
            return
        values_start = _aligned(fixed_words)
        if spill_words:
            # Both parts are mapped in whole units of the driver's granularity.
            unit = granularity(self._device_index) // WORD_BYTES if self._cuda else self._cpu_mapping_words
            device_words = -(-(values_start + value_words) // unit) * unit
            host_words = -(-(spill_words + 1) // unit) * unit
            try:
                buffer = self._mapped_buffer(device_words, host_words)
                value_words, spill_words = device_words - values_start, host_words - 1
            except RuntimeError as error:  # torch.OutOfMemoryError included
                # No worse off than without a spill region: this arena goes on without one.
                self._spill_refused = True
                spill_words = 0
                requested = (fixed_words, value_words, 0)
                warnings.warn(
                    f"BitSparse could not map its arena's spill region in host memory ({error}); it goes on "
                    "without one (and does not try again), holding the tensors it is not sure of room for until "
                    "the GPU confirms them. host_spill=False turns the spill region off.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if not spill_words:
            buffer = torch.empty(values_start + value_words + 1, dtype=torch.int32, device=self.device)
        # The cursor, the encoders' two scratch words (see ValueBuffer) and the tally.
        counters = torch.zeros(COUNTER_WORDS, dtype=torch.int64, device=self.device)
        if self._last_end:
            counters[0].fill_(self._last_end)
        self._make_start_slots(self._wanted_start_slots)
        self.cursor, self.appends, self.tally = counters[:1], counters[1:3], counters[3:]
        self._buffer, self.values = buffer, ValueBuffer.over(buffer[values_start:], counters[:3])
        self._values_capacity, self._device_value_words = value_words + spill_words, value_words
        self._spill_words = spill_words
        self._fixed_capacity, self._requested = fixed_words, requested  # open: reserve_fixed hands out words
        self._update_hold_allowance()

    def _mapped_buffer(self, device_words: int, host_words: int) -> torch.Tensor:
        """``device_words`` of device memory followed by ``host_words`` of host memory, in
        one range of addresses (a simulating CPU arena's are all host memory)."""
        if self._cuda:
            return device_then_host(self.device, device_words * WORD_BYTES, host_words * WORD_BYTES)
        return torch.empty(device_words + host_words, dtype=torch.int32)

    def _make_start_slots(self, count: int) -> None:
        self._start_slots = ()  # the old slots are released first
        self._start_slots = torch.empty(count, dtype=torch.int64, device=self.device).split(1)

    @property
    def capacity_bytes(self) -> int:
        """The buffer's device memory."""
        if self._buffer is None:
            return 0
        return self._buffer.numel() * WORD_BYTES - self.spill_bytes

    @property
    def spill_bytes(self) -> int:
        """The buffer's host memory: the value region's host part and the guard."""
        return (self._spill_words + 1) * WORD_BYTES if self._spill_words else 0

    @property
    def values_capacity_words(self) -> int:
        """Usable words of the value region, both parts (its guard excluded)."""
        return self._values_capacity

    @property
    def device_value_words(self) -> int:
        """Usable words of the value region's device part: the words past them are host memory."""
        return self._device_value_words

    @property
    def fixed_capacity_words(self) -> int:
        return self._fixed_capacity

    @property
    def reserved_bytes(self) -> int:
        """All the device memory the arena holds: none without a buffer."""
        if self.cursor is None:
            return self.capacity_bytes
        return self.capacity_bytes + 8 * (COUNTER_WORDS + len(self._start_slots))

    def reserve_fixed(self, words: int) -> torch.Tensor | None:
        """``words`` int32 words of the fixed region, or None when the region is full (or the
        device had no room for the planned buffer: see ``out_of_memory``).

        Until a step stores anything, the arena holds its buffer only for an append that can
        fit in it (see ``_room_for_first``): a step whose tensors are all larger than the
        arena, which it was planned for smaller steps, holds no device memory for it."""
        if self._fixed_used == 0 and not self._room_for_first(words):
            self._fixed_demand += words
            return None
        if self._planned is not None:
            self._allocate_planned()
        self._fixed_demand += words
        start = self._fixed_used
        if self._fixed_used + words > self._fixed_capacity:
            return None
        self._fixed_used += words
        view = self._fixed_views.get((start, words))
        if view is None:
            if len(self._fixed_views) >= MAX_CACHED_VIEWS:
                self._fixed_views.clear()
            view = self._fixed_views[start, words] = self._buffer[start : start + words]
        return view

    def _room_for_first(self, words: int) -> bool:
        """Whether the buffer (planned or made) is for an append of ``words`` fixed words
        while nothing is stored in it: the step's first append, whose fixed words fit in the
        fixed region. Where it is not, a buffer the arena may let go of at once goes, its plan
        kept for a later step: one without a spill region (releasing that waits for the
        device) and with no lease open; a buffer that stays takes the append as before. A
        step that measured an append without a buffer stores nothing in one (the buffer's
        cursor would start past the values measured), as a first step does."""
        if self._buffer is not None and (self._spill_words or self.leased):
            return True
        if words <= (self._planned or (self._fixed_capacity,))[0] and not self._appends:
            return True
        if self._buffer is not None:
            self.release_buffer()
        return False

    def _allocate_planned(self) -> None:
        """Allocate the planned buffer. Where the device has no room for it, the arena goes on
        without one for the rest of the step, whose appends are only measured (in host
        memory), so that its callers keep what they would have stored as it is, as without
        the arena, rather than fail; the plans after it take at most half of it."""
        planned = self._planned
        try:
            self._allocate(*planned)
        except torch.OutOfMemoryError as error:
            # _allocate closed the arena first: it has no buffer, and no plan, until the next step.
            planned_words = planned[0] + planned[1]
            self._room_words, self.out_of_memory = planned_words // 2, True
            warnings.warn(
                f"BitSparse: no room on {self.device} for its arena of {planned_words * WORD_BYTES} bytes ({error}); "
                "this step keeps the tensors it would have stored as they are, and the next steps plan arenas of at "
                f"most {self._room_words * WORD_BYTES} bytes (bitsparse.reset() lifts that limit).",
                RuntimeWarning,
                stacklevel=2,
            )

    def next_start(self) -> torch.Tensor:
        """An int64 ``[1]`` device word for the next append to write where its values start,
        distinct from every other append's until the arena is emptied."""
        index = self._starts_used
        self._starts_used += 1
        if index < len(self._start_slots):
            return self._start_slots[index]
        return torch.empty(1, dtype=torch.int64, device=self.device)  # more slots next step

    def on_append_stream(self) -> bool:
        """Whether the current stream may append now: the first append after the arena was
        emptied fixes the stream (encoders read and move the cursor in stream order)."""
        if not self._cuda:
            return True
        # The raw handle: building a torch.cuda.Stream object per append costs host time.
        stream = torch._C._cuda_getCurrentRawStream(self._device_index)
        if self._stream is None:
            self._stream = stream
            self.stream = torch.cuda.current_stream(self.device)
        return stream == self._stream

    def order_reads(self) -> None:
        """Make what the appends wrote safe to read on the current stream: on the append
        stream, stream order does it; on another (a decoder there), every outstanding append
        is waited for."""
        if self._pending and self._stream is not None:
            if torch._C._cuda_getCurrentRawStream(self._device_index) != self._stream:
                self.drain()

    # -- confirmation ---------------------------------------------------------------------

    def next_report(self, max_words: int, held_words: int) -> tuple[int, torch.Tensor | None, bool]:
        """A report slot for the next append, whose values take at most ``max_words`` words
        and whose caller holds ``held_words`` words of memory until it is confirmed (0:
        nothing): its number, for ``submit``, the word to pass to the codec (None off CUDA,
        where ``submit`` reads the cursor and reports at once), and whether the append is sure
        to fit (never off CUDA).

        An append that is not sure to fit first takes the reports that have arrived. One that
        holds memory and is still not sure is throttled: while ``window`` throttled appends
        are unconfirmed, or one is and this one's memory would take the held words past the
        hold allowance, it first waits for reports, oldest first, until neither holds or the
        reports make it sure.
        """
        if not self._free_reports:
            self._add_report_slots()
        slot = self._free_reports.pop()
        if not self._asynchronous:
            self._claims[slot] = (0, 0, False)
            return slot, None, False
        sure = self._sure_to_fit(max_words)
        if not sure and self._pending:
            self._deliver_arrived()
            sure = self._sure_to_fit(max_words)
        while held_words and not sure and self._must_wait(held_words):
            self._window_waits += 1
            self._deliver(wait=True)
            sure = self._sure_to_fit(max_words)
        self._claims[slot] = (max_words, 0 if sure else held_words, sure)
        self._unreported_words += max_words
        return slot, self._report_slots[slot], sure

    def _must_wait(self, held_words: int) -> bool:
        """Whether a throttled append that holds ``held_words`` must wait (see ``next_report``)."""
        throttled = self._throttled
        return throttled > 0 and (
            self._held_words + held_words > self._hold_allowance
            or (self.window is not None and throttled >= self.window)
        )

    def _sure_to_fit(self, max_words: int) -> bool:
        """Whether ``max_words`` more words fit however much the unreported appends take."""
        return self._last_end + self._unreported_words + max_words <= self._values_capacity

    def _add_report_slots(self) -> None:
        ends = torch.zeros(REPORT_SLOTS, dtype=torch.int64, pin_memory=self._cuda)
        first = len(self._report_slots)
        slots = self._report_slots + list(ends.split(1))
        report_ends = self._report_ends + [ends.numpy()[i : i + 1] for i in range(REPORT_SLOTS)]
        claims = self._claims + [(0, 0, False)] * REPORT_SLOTS
        free = self._free_reports + list(range(first + REPORT_SLOTS - 1, first - 1, -1))
        # One statement, which an exception (Ctrl-C) cannot cut: the four lists stay in step.
        self._report_slots, self._report_ends, self._claims, self._free_reports = slots, report_ends, claims, free

    def submit(self, slot: int, on_end: Callable[[int, int], None] | None = None) -> int:
        """Submit the append given ``slot`` by ``next_report``; return its number among the
        appends since the arena was emptied (its place in ``ends``).

        ``on_end(start, end)``, when given, receives the value words it appended: ``start``
        is the cursor after the append before it, ``end`` after it. On CUDA it comes from a
        later ``poll`` (the append must have been given the word of ``slot``); elsewhere at
        once. An append that ``next_report`` throttled counts in the window until its report
        is delivered. Reports that no callback or throttled append waits for are delivered
        by ``drain`` (or by a later append that needs them to be sure).
        """
        number = self._appends
        self._appends += 1
        if not self._asynchronous:
            self._report_ends[slot][0] = int(self.cursor) + 1
            self._pending.append((slot, on_end))
            self._deliver(wait=False)
            return number
        self._pending.append((slot, on_end))
        held = self._claims[slot][1]
        if held:
            self._throttled += 1
            self._held_words += held
        if held or on_end is not None:
            self._awaited += 1
        return number

    def poll(self, awaited_only: bool = False) -> None:
        """Deliver the reports that have arrived (with ``awaited_only``, only if a callback
        or a throttled append waits for one); never blocks."""
        if self._awaited or not awaited_only:
            self._deliver_arrived()

    def next_measure(self, tiles: int) -> torch.Tensor:
        """For an append only measured while the arena holds no device memory (no buffer,
        hence no cursor): an int32 ``[tiles]`` tensor of host memory the device can write
        (pinned on CUDA) for the words each tile would take (a codec's ``measure_tiles``),
        to give ``submit_measure`` once the codec was called. A first step then asks nothing
        of the device's memory."""
        tile_words = torch.empty(tiles, dtype=torch.int32, pin_memory=self._cuda).fill_(-1)  # -1: not written
        # Held until its words are delivered: the device may write them after the caller let
        # go (an exception between the launch and submit_measure), and memory PyTorch reused
        # meanwhile would receive them.
        self._measuring[id(tile_words)] = tile_words
        return tile_words

    def submit_measure(self, tile_words: torch.Tensor) -> int:
        """Submit the append measured into ``tile_words`` (from ``next_measure``); return its
        number, as ``submit`` does. It ends where the one before it did plus the words' sum,
        which ``drain`` delivers once every tile's words arrived."""
        del self._measuring[id(tile_words)]
        number = self._appends
        self._appends += 1
        self._measured.append(tile_words.numpy())  # the array holds the tensor
        return number

    def _deliver_arrived(self) -> None:
        pending, ends = self._pending, self._report_ends
        while pending and ends[pending[0][0]][0]:
            self._deliver(wait=False)

    def drain(self) -> None:
        """Deliver every outstanding report, waiting for the GPU if needed; let go of the tile
        words that ``next_measure`` handed out and nobody submitted (an exception cut their
        append short), once the device can no longer write them."""
        while self._measured:
            self._deliver_measured()
        while self._pending:
            self._deliver(wait=True)
        if self._measuring:
            if self._cuda:  # rare (an interrupted append): a kernel may still write them
                torch.cuda.synchronize(self.device)
            self._measuring.clear()

    def ends(self) -> list[int]:
        """The value cursor after each append since the arena was emptied, in order, as far as
        delivered (``drain`` delivers all): append ``n`` (from ``submit``) took the words from
        ``ends[n - 1]`` (0 for the first) to ``ends[n]``, or would have: an append that ends
        past ``values_capacity_words`` did not fit (and was kept dense by its caller)."""
        return self._ends

    def _deliver(self, wait: bool) -> None:
        slot, callback = self._pending[0]
        if wait and not self._report_ends[slot][0]:
            # Before anything changes: an exception (Ctrl-C) while it waits, the likeliest
            # place for one, leaves the report to a later delivery.
            try:
                self._wait_for(slot)
            except RuntimeError:  # it never comes: the deliveries after it go on without it
                self._take_oldest()
                raise
        words, sure = self._take_oldest()
        report = self._report_ends[slot]
        end = int(report[0]) - 1
        report[0] = 0  # a free slot's word is 0 (here, not when it is taken: the forward has less to do)
        self._unreported_words -= words
        self._free_reports.append(slot)
        # The end first: an exception (Ctrl-C) between the two leaves ``_last_end`` one append
        # behind, which the next delivery sets right (and only makes appends less sure until
        # then), where an end missing from ``ends`` would give the next append two appends' words.
        self._ends.append(end)
        start, self._last_end = self._last_end, end
        if sure and end > self._values_capacity:
            raise RuntimeError(
                f"BitSparse: an append the arena was sure of ended at word {end}, past the value region's "
                f"{self._values_capacity} words, and its caller kept nothing else of what it stored. This is a bug "
                "in BitSparse; please report it."
            )
        if callback is not None:
            callback(start, end)

    def _take_oldest(self) -> tuple[int, bool]:
        """Take the oldest pending append off the queue and out of the counts that wait for
        it; return the value words it may take at most and whether it was sure to fit."""
        slot, callback = self._pending.popleft()
        words, held, sure = self._claims[slot]
        if held:
            self._throttled -= 1
            self._held_words -= held
        if held or callback is not None:
            self._awaited -= 1
        return words, sure

    def _deliver_measured(self) -> None:
        """Deliver the oldest append measured in host memory, waiting for its words if needed."""
        tile_words = self._measured[0]
        if tile_words.min() < 0:  # the device writes no negative word: some are still to come
            try:  # before anything changes, as in _deliver
                self._spin_until(lambda: tile_words.min() >= 0)
            except RuntimeError:  # they never come
                self._measured.popleft()
                raise
        self._measured.popleft()
        # From the last end in ``ends``, not ``_last_end``, which an exception (Ctrl-C) may
        # have left one append behind (see _deliver).
        end = (self._ends[-1] if self._ends else 0) + int(tile_words.sum())
        self._ends.append(end)
        self._last_end = end

    def _wait_for(self, slot: int) -> None:
        """Spin until the slot's report arrives (see ``_spin_until``)."""
        report = self._report_ends[slot]
        self._spin_until(lambda: report[0] != 0)

    def _spin_until(self, arrived: Callable[[], bool]) -> None:
        """Spin until a report has arrived (``arrived()``); after ``REPORT_TIMEOUT_S``,
        synchronize the device instead (every write of a finished kernel is visible then)."""
        deadline = time.monotonic() + REPORT_TIMEOUT_S
        while not arrived():
            if time.monotonic() > deadline:
                if self._cuda:
                    torch.cuda.synchronize(self.device)
                if not arrived():
                    raise RuntimeError(
                        "an append never reported its end: was it given this arena's report slot "
                        "(next_report) and queued on this device?"
                    )

    # -- life cycle -----------------------------------------------------------------------

    def open_lease(self, words: int = 0) -> Lease:
        """Claim the arena's contents, for a holder that would take ``words`` without the
        arena: ``begin_step`` keeps them until the lease is released."""
        return Lease(self, words)

    @property
    def open_leases(self) -> int:
        """How many leases are open: made, not released, not dropped."""
        return len(self._open_lease_refs())

    def _open_lease_refs(self) -> list[weakref.ref]:
        """The references to the open leases; those to the others are dropped."""
        refs = [ref for ref in self._lease_refs if (lease := ref()) is not None and lease.is_open]
        self._lease_refs = refs
        return refs

    @property
    def leased(self) -> bool:
        return self.open_leases > 0

    def begin_step(
        self,
        fixed_words: int | None,
        value_words: int | None,
        dense_words: int | None = None,
        most_value_words: int = 0,
        *,
        expected_words: int | None = None,
        budget_words: int | None = None,
    ) -> bool:
        """Note the demand of the last step this arena served and empty it for a new step,
        unless a lease is open; return whether it did. That step needed ``fixed_words`` and
        ``value_words`` (None when it asked nothing of the arena, which says nothing of the
        next) for tensors that take ``dense_words`` dense (None: not known) and whose values
        could take ``most_value_words`` at most.

        Before emptying, it delivers the last step's reports and, if ``growable`` and any
        recent step stored anything, plans each region at the most that any of the last
        ``DEMAND_STEPS`` steps that stored anything asked of it, times ``HEADROOM``, when that
        is above ``GROW_WHEN_ABOVE`` of its size or under half of it. Given
        ``expected_words``, the dense words the new step is expected to take, a step that took
        more counts as scaled down to it: the warmup of a pipeline schedule (several forwards
        in one step) is not like the steps after it. Both device
        regions together take at most the fewest dense words of those steps and of the last
        one, ``budget_words`` (None: no budget) and half of the last buffer the device had no
        room for (see ``reserve_fixed``; none before), less what comes with a buffer
        (``_words_beside_regions``): where they would take more, that smallest step keeps room
        for its own demand, and the regions share the rest as the plan does (see
        ``_within_dense``); no buffer after a step that stored nothing. The spill region's
        demand is the most value words less the value region's device part, capped at this
        device's share of ``SPILL_SHARE_OF_HOST`` of the host's available memory. A region
        that changes is released now and allocated again at the first ``reserve_fixed``.
        The step's hold allowance is the least of ``dense_words`` and the budget, less the
        arena's device memory.
        """
        demand = (fixed_words, value_words, most_value_words, dense_words)
        if self.growable and fixed_words:
            self._demands.append(demand)
        if self.leased:
            return False
        self.drain()
        self._expected_dense_words = min((w for w in (dense_words, budget_words) if w is not None), default=0)
        # Every append of the last step (measured ones too) may need a start word in this one.
        if self._appends > self._wanted_start_slots:
            self._wanted_start_slots = math.ceil(self._appends * HEADROOM)
        steps = self._demands if fixed_words or fixed_words is None else (*self._demands, demand)
        if self.growable and steps:
            if expected_words is not None:
                steps = [_scaled(step, expected_words) for step in steps]
            most = [max(step[i] for step in steps) for i in range(3)]  # fixed, value, most value words
            known = [step for step in steps if step[3] is not None]
            self._plan(*most, min(known, key=lambda step: step[3], default=None), budget_words)
        self._update_hold_allowance()
        if self._buffer is not None:
            if len(self._start_slots) < self._wanted_start_slots:
                self._make_start_slots(self._wanted_start_slots)
            self.cursor.zero_()
        self._empty()
        return True

    @property
    def stored_share(self) -> float | None:
        """The most that the recent steps' tensors took stored over what they take dense
        (None: not known)."""
        shares = [(step[0] + step[1]) / step[3] for step in self._demands if step[3]]
        return max(shares, default=None)

    def plan_like(self, other: "Arena") -> None:
        """Plan from ``other``'s demand history (the steps it served), for steps like those,
        within the room its device had (see ``_allocate_planned``)."""
        self._demands = collections.deque(other._demands, maxlen=DEMAND_STEPS)
        self._wanted_start_slots, self._room_words = other._wanted_start_slots, other._room_words

    def release_buffer(self) -> None:
        """Let the buffer go (an arena no step needs now): it is made again as planned at
        the next ``reserve_fixed``. Only while no lease is open.

        Raises:
            RuntimeError: a lease is open.
        """
        plan = self._planned or self._requested
        self._allocate(0, 0)
        if plan[0]:
            self._planned = plan

    @property
    def excess_words(self) -> int:
        """The device memory (in words) the arena holds beyond what the holders of its open
        leases would take without it (see ``Lease``): what a caller that bounds several
        arenas' memory by their tensors' dense size counts against the others."""
        leased = sum(lease.words for ref in self._open_lease_refs() if (lease := ref()) is not None)
        return max(0, self.reserved_bytes // WORD_BYTES - leased)

    def _empty(self) -> None:
        """Start the step's accounting afresh (nothing is pending): what an exception (Ctrl-C)
        cut short in the last step's is not carried over."""
        self.out_of_memory = False
        """Whether the device had no room for the buffer planned for this step (which then
        goes on without one: see ``reserve_fixed``)."""
        self._awaited = 0
        """Pending appends whose delivery someone waits for: with a callback, or throttled."""
        self._throttled = 0
        self._held_words = 0
        """Words the callers of the unconfirmed throttled appends hold."""
        self._fixed_used = 0
        self._fixed_demand = 0
        self._last_end = 0
        """The cursor after the last delivered append (where the next one starts)."""
        self._ends: list[int] = []
        self._starts_used = 0
        self._appends = 0
        self._window_waits = 0
        self._unreported_words = 0
        self._stream = None
        self.stream: torch.cuda.Stream | None = None
        """The append stream, once fixed (CUDA)."""

    def usage(self) -> ArenaUsage:
        """What the arena holds, and what was asked of it since it was emptied (appends count
        once confirmed; see ``drain``)."""
        return ArenaUsage(
            capacity=self.capacity_bytes,
            reserved=self.reserved_bytes,
            values_capacity=self._device_value_words * WORD_BYTES,
            spill_capacity=self._spill_words * WORD_BYTES,
            spilled=max(0, min(self._last_end, self._values_capacity) - self._device_value_words) * WORD_BYTES,
            fixed_used=self._fixed_used * WORD_BYTES,
            fixed_demand=self._fixed_demand * WORD_BYTES,
            values_demand=self._last_end * WORD_BYTES,
            window_waits=self._window_waits,
        )

    def _update_hold_allowance(self) -> None:
        """The words throttled appends may hold together (beyond the first): the step's
        tensors' dense size less the arena's device memory (as planned), none when the arena
        is not smaller."""
        fixed, values, _ = self._planned or (self._fixed_capacity, self._device_value_words, 0)
        self._hold_allowance = max(0, self._expected_dense_words - fixed - values)

    def _plan(
        self,
        fixed_demand: int,
        values_demand: int,
        most_value_words: int,
        smallest: tuple | None,
        budget_words: int | None = None,
    ) -> None:
        """Plan the regions for a step's demand (in words), where it differs enough, the
        device regions within the dense words of ``smallest``, a step's demand (see
        ``begin_step``; None: not known), within ``budget_words`` (None: none), and within
        the room the device had (see ``_allocate_planned``)."""

        def planned(current: int, demand: int) -> int:
            if demand > GROW_WHEN_ABOVE * current or demand * 2 < current:
                return math.ceil(demand * HEADROOM)
            return current

        current = self._planned or self._requested
        fixed, values = planned(current[0], fixed_demand), planned(current[1], values_demand)
        rooms = [words for words in (smallest and smallest[3], budget_words, self._room_words) if words is not None]
        if rooms:
            # The rest of what the arena allocates with its buffer counts too.
            room = max(0, min(rooms) - self._words_beside_regions())
            if fixed + values > room:
                own = smallest[:3] if smallest is not None else (fixed, values, 0)
                fixed, values = _within_dense(fixed, values, (*own, room))
        if not fixed:  # no buffer: the step stores nothing
            values = 0
        spill = 0
        if fixed and self.spills:
            spill = max(0, most_value_words - values)
            if spill > current[2]:
                # Shared by the processes of a host's devices (one per device, as torchrun runs them).
                devices = torch.cuda.device_count() if self._cuda else 1
                share = psutil.virtual_memory().available * SPILL_SHARE_OF_HOST / devices
                spill = min(spill, int(share) // WORD_BYTES)
            spill = planned(current[2], spill) if spill else 0
        plan = (fixed, values, spill)
        if plan != current:
            self._allocate(0, 0)  # released now, allocated when first needed
            self._planned = plan

    def _words_beside_regions(self) -> int:
        """The most device memory (in words) a buffer comes with beside its regions: the
        counters, the start words, the value region's alignment and guard, each allocation
        rounded up to the caching allocator's 512-byte blocks."""
        start_bytes = -(-8 * self._wanted_start_slots // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK
        return (ALLOCATOR_BLOCK + start_bytes + 2 * ALLOCATOR_BLOCK) // WORD_BYTES


def _aligned(fixed_words: int) -> int:
    """Where the value region starts after ``fixed_words`` of fixed region: the next multiple
    of ``ALIGN_WORDS``."""
    return -(-fixed_words // ALIGN_WORDS) * ALIGN_WORDS


def _scaled(step: tuple, dense_words: int) -> tuple:
    """A step's demand (see ``Arena.begin_step``) scaled down in proportion to what a step of
    ``dense_words`` dense words would ask, where it took more."""
    if step[3] is None or step[3] <= dense_words:
        return step
    scale = dense_words / step[3]
    return (*(math.ceil(words * scale) for words in step[:3]), dense_words)


def _within_dense(fixed: int, values: int, smallest: tuple) -> tuple[int, int]:
    """The fixed and value words of a plan (``fixed`` and ``values``, more than ``smallest``'s
    dense words together) cut to take no more device memory together than the tensors of the
    step ``smallest`` (its fixed, value, most value and dense words) take dense: that step's
    own demand with its headroom first, and the words shared as the plan shares them. A larger
    step then stores the tensors whose fixed parts fit with their values on the device, and
    keeps the others dense (its fixed region is full): with the fixed region first, it would
    store them all, and the values that did not fit would go to the spill region, over PCIe
    and back, at every such step."""
    own_fixed, own_values, _, dense = smallest
    own_fixed, own_values = min(fixed, math.ceil(own_fixed * HEADROOM)), min(values, math.ceil(own_values * HEADROOM))
    if own_fixed + own_values > dense:  # a step that shrinks by less than the headroom
        scale = dense / (own_fixed + own_values)
        return int(own_fixed * scale), int(own_values * scale)
    fixed_share = min(max(own_fixed, fixed * dense // (fixed + values)), dense - own_values)
    return fixed_share, min(values, dense - fixed_share)
