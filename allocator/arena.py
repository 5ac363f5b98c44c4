"""The arena: one preallocated buffer per device, handed out without waiting for the GPU.

The buffer is a run of int32 words in two regions:

* the *fixed* region holds parts whose size the host knows from a tensor's shape (bitmasks,
  tile words). They are handed out at host-known positions by a host-side bump pointer;
* the *value* region receives value streams, appended on the device: kernels advance a
  device-side cursor (see ``bitsparse.ValueBuffer``), so the host never learns sizes in time.

Each append also gets a *start word* (``next_start``), an int64 device word in which its
encoder records where its values begin.

The host learns how far the value cursor went asynchronously: each append on CUDA gets a
*report slot* (``next_report``), a word of pinned host memory that its encoder sets to the
end of the append plus one when it finishes; ``poll`` reads the slots, with no CUDA call and
without blocking, and reports each append's end to its callback (given to ``submit``). At
most ``window`` appends stay unconfirmed: when one more arrives, the oldest is waited for.
That wait only happens when the host runs more than ``window`` appends ahead of the GPU, so
it throttles the host and costs the GPU nothing.

Leases tie the arena's life cycle to its users: while any lease is open, nothing is
reused. When the last one is released the step is over: the next ``open_lease`` resets both
regions, after growing the buffer if the step overflowed or came close to.

The arena knows nothing of autograd or of the format: it hands out words.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from bitsparse.compressed import ValueBuffer

WORD_BYTES = 4
GROW_WHEN_ABOVE = 0.9
"""A region is grown when a step used more than this fraction of it."""
HEADROOM = 1.15
"""A grown region is this much larger than the step's demand."""
REPORT_TIMEOUT_S = 1.0
"""How long a wait spins on a report slot before it synchronizes the device instead."""
INITIAL_START_SLOTS = 64
"""Start words made with the arena; more are made between steps when a step needed more."""
MAX_CACHED_VIEWS = 4096
"""Fixed-region views kept for reuse; the cache is emptied when it grows past this."""


@dataclass
class ArenaUsage:
    """What the last finished step (or the one in progress) asked of the arena, in bytes."""

    capacity: int
    values_capacity: int
    fixed_used: int
    fixed_demand: int
    values_demand: int
    window_waits: int

    @property
    def peak(self) -> int:
        """Bytes in use at the step's end (its peak, since nothing is freed within a step)."""
        return self.fixed_used + min(self.values_demand, self.values_capacity)


class Lease:
    """A claim on the arena's current contents; release it (once) when they are not needed."""

    __slots__ = ("_arena", "__weakref__")

    def __init__(self, arena: "Arena"):
        self._arena = arena

    def release(self) -> None:
        if self._arena is not None:
            arena, self._arena = self._arena, None
            arena._lease_released()


class Arena:
    """One device buffer for the compressed tensors of a training step.

    Args:
        device: the device of the buffer.
        capacity_bytes: initial size of the buffer.
        fixed_fraction: initial share of the buffer for the fixed region.
        window: most appends whose end the host has not confirmed yet.
        growable: grow (and shrink) the regions between steps to fit the last step's demand.
    """

    def __init__(
        self,
        device: torch.device | str,
        capacity_bytes: int,
        *,
        fixed_fraction: float = 0.25,
        window: int = 8,
        growable: bool = True,
    ):
        if capacity_bytes < 2 * WORD_BYTES * 8:
            raise ValueError(f"arena capacity must be at least 64 bytes, got {capacity_bytes}")
        if not 0 < fixed_fraction < 1:
            raise ValueError(f"fixed_fraction must be between 0 and 1, got {fixed_fraction}")
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.device = torch.device(device)
        self.window = window
        self.growable = growable
        self._cursor = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._device_index = self._cursor.get_device()
        words = capacity_bytes // WORD_BYTES
        fixed = max(1, int(words * fixed_fraction))
        self._allocate(fixed, words - fixed)
        self._allocate_start_slots(INITIAL_START_SLOTS)
        self._starts_used = 0
        self._asynchronous = self.device.type == "cuda"
        if self._asynchronous:
            # A ring of window + 1 report slots: slot k is reused only after its last report
            # was delivered. Made once, since each append is host time.
            ends = torch.zeros(window + 1, dtype=torch.int64, pin_memory=True)
            self._report_slots = ends.split(1)
            self._ends = ends.numpy()
        self._pending: collections.deque = collections.deque()
        self._step = 0
        self._last_report = (0, 0)
        self._submitted = 0
        self._leases = 0
        self._step_over = False
        self._begin_step()

    # -- layout -------------------------------------------------------------------------

    def _allocate(self, fixed_words: int, value_words: int) -> None:
        self._buffer = torch.empty(value_words + fixed_words, dtype=torch.int32, device=self.device)
        # The value region's last word is its guard (see ValueBuffer).
        self.values = ValueBuffer.wrap(self._buffer[:value_words], self._cursor)
        self._fixed_start = value_words
        # Steps of a training loop reserve the same spans: their views are made once, since
        # making a view is host time on every stored tensor.
        self._fixed_views: dict[tuple[int, int], torch.Tensor] = {}

    def _allocate_start_slots(self, count: int) -> None:
        self._start_slots = torch.empty(count, dtype=torch.int64, device=self.device).split(1)

    @property
    def capacity_bytes(self) -> int:
        return self._buffer.numel() * WORD_BYTES

    @property
    def fixed_capacity_words(self) -> int:
        return self._buffer.numel() - self._fixed_start

    def reserve_fixed(self, words: int) -> torch.Tensor | None:
        """``words`` int32 words of the fixed region, or None when the region is full."""
        self._fixed_demand += words
        start = self._fixed_start + self._fixed_used
        if self._fixed_used + words > self.fixed_capacity_words:
            return None
        self._fixed_used += words
        view = self._fixed_views.get((start, words))
        if view is None:
            if len(self._fixed_views) >= MAX_CACHED_VIEWS:
                self._fixed_views.clear()
            view = self._fixed_views[start, words] = self._buffer[start : start + words]
        return view

    def next_start(self) -> torch.Tensor:
        """An int64 ``[1]`` device word for the next append to write where its values start
        (``compress(base=...)``), distinct from every other append's until the step ends."""
        index = self._starts_used
        self._starts_used += 1
        if index < len(self._start_slots):
            return self._start_slots[index]
        return torch.empty(1, dtype=torch.int64, device=self.device)  # more slots next step

    def on_append_stream(self) -> bool:
        """Whether the current stream may append now: the first append of a step fixes the
        stream (encoders read and move the cursor in stream order; see ``ValueBuffer``)."""
        if not self._asynchronous:
            return True
        # The raw handle: building a torch.cuda.Stream object per append costs host time.
        stream = torch._C._cuda_getCurrentRawStream(self._device_index)
        if self._stream is None:
            self._stream = stream
        return stream == self._stream

    # -- confirmation ---------------------------------------------------------------------

    def next_report(self) -> torch.Tensor | None:
        """The report slot for the next append (pass it to ``compress(report=...)``), then
        ``submit`` once the append is queued. None off CUDA, where ``submit`` reads the cursor.

        Waits for the oldest unconfirmed append first when ``window`` are unconfirmed.
        """
        if not self._asynchronous:
            return None
        if len(self._pending) >= self.window:
            self._window_waits += 1
            self._deliver(wait=True)
        self._ends[self._next_slot] = 0
        return self._report_slots[self._next_slot]

    def submit(self, on_end: Callable[[int, int], None]) -> None:
        """Report to ``on_end(start, end)`` the value words appended since the last ``submit``
        of this step: ``start`` is the cursor then, ``end`` the cursor after the queued work.

        On CUDA the report comes from a later ``poll`` (the append must have been given the
        slot from ``next_report``); elsewhere it comes at once.
        """
        if not self._asynchronous:
            self._record_end(int(self._cursor), on_end, self._step)
            return
        self._pending.append((self._next_slot, self._step, on_end))
        self._submitted += 1

    @property
    def _next_slot(self) -> int:
        """The ring slot of the next append's report."""
        return self._submitted % (self.window + 1)

    def poll(self) -> None:
        """Deliver the reports that have arrived; never blocks."""
        while self._pending and self._ends[self._pending[0][0]]:
            self._deliver(wait=False)

    def drain(self) -> None:
        """Deliver every outstanding report, waiting for the GPU if needed."""
        while self._pending:
            self._deliver(wait=True)

    def _deliver(self, wait: bool) -> None:
        slot, step, callback = self._pending.popleft()
        if wait:
            self._wait_for(slot)
        self._record_end(int(self._ends[slot]) - 1, callback, step)

    def _wait_for(self, slot: int) -> None:
        """Spin until the slot's report arrives; after ``REPORT_TIMEOUT_S``, synchronize the
        device instead (every write of a finished kernel is visible then)."""
        deadline = time.monotonic() + REPORT_TIMEOUT_S
        while not self._ends[slot]:
            if time.monotonic() > deadline:
                torch.cuda.synchronize(self.device)
                if not self._ends[slot]:
                    raise RuntimeError(
                        "an append never reported its end: was it given this arena's report slot "
                        "(next_report) and queued on this device?"
                    )

    def _record_end(self, end: int, callback: Callable[[int, int], None], step: int) -> None:
        last_step, last_end = self._last_report
        start = last_end if last_step == step else 0
        self._last_report = (step, end)
        if step == self._step:
            self._values_demand = max(self._values_demand, end)
        callback(start, end)

    # -- life cycle -----------------------------------------------------------------------

    def open_lease(self) -> Lease:
        """Claim the arena's contents; the first lease of a step resets the arena."""
        if self._step_over:
            self._begin_step()
        self._leases += 1
        return Lease(self)

    def _lease_released(self) -> None:
        self._leases -= 1
        if self._leases == 0:
            self._step_over = True

    @property
    def step_over(self) -> bool:
        """True once every lease of the step has been released."""
        return self._step_over

    def usage(self) -> ArenaUsage:
        """The current step's demand so far (only confirmed appends count; see ``drain``)."""
        return ArenaUsage(
            capacity=self.capacity_bytes,
            values_capacity=self.values.capacity * WORD_BYTES,
            fixed_used=self._fixed_used * WORD_BYTES,
            fixed_demand=self._fixed_demand * WORD_BYTES,
            values_demand=self._values_demand * WORD_BYTES,
            window_waits=self._window_waits,
        )

    def _begin_step(self) -> None:
        # Reports still in flight belong to the step that just ended; deliver them if ready.
        self.poll()
        if self._step_over and self.growable and (self._fixed_demand or self._values_demand):
            self._fit(self._fixed_demand, self._values_demand, complete=not self._pending)
        self._step += 1
        self._cursor.zero_()
        self._fixed_used = 0
        self._fixed_demand = 0
        self._values_demand = 0
        if self._starts_used > len(self._start_slots):
            self._allocate_start_slots(math.ceil(self._starts_used * HEADROOM))
        self._starts_used = 0
        self._window_waits = 0
        self._stream = None
        self._step_over = False

    def _fit(self, fixed_demand: int, values_demand: int, complete: bool) -> None:
        """Resize the regions to the last step's demand: grow when it came close to a region's
        size, shrink when it used less than half (only when every report is in and nothing
        was refused, since otherwise the demand known is a lower bound)."""
        value_words = self.values.capacity + 1
        fixed_words = self.fixed_capacity_words

        # After a refusal the demand of what was refused is unknown: shrink nothing then.
        may_shrink = complete and fixed_demand <= fixed_words and values_demand < value_words

        def planned(current: int, demand: int) -> int:
            if demand > GROW_WHEN_ABOVE * current or (may_shrink and demand * 2 < current):
                return max(8, math.ceil(demand * HEADROOM))
            return current

        new_fixed, new_values = planned(fixed_words, fixed_demand), planned(value_words, values_demand + 1)
        if (new_fixed, new_values) != (fixed_words, value_words):
            self._buffer = None  # free the old buffer before taking the new one
            self._allocate(new_fixed, new_values)
