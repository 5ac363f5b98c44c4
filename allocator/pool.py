"""The arenas of one device: one for each step whose compressed tensors are alive.

An arena is emptied at a step's start only when nothing it holds is alive. Where steps
overlap (a pipeline schedule runs a microbatch's forward while earlier microbatches wait for
their backward; a graph is kept without its backward), the new step is served by another
arena, so that each step's memory goes with its own tensors rather than with the last of
everyone's: the *primary* arena (the first, the only one that may spill to host memory) if
it is free, else the arena that served the last step if it is, else another free one, else
a new one that plans from the demand history of the arena that served the last step.

Free arenas that serve no step let their buffers go at once, and arenas are resized as the
steps they serve change, so none may be mapped with a spill region (releasing a mapped buffer
waits for the device): only the primary spills, and only until steps overlap. Its buffer is
then mapped without one at its next plan, the one wait of the kind; nothing else here waits
for the GPU.

Overlapping steps hold several buffers at once. Each is planned as an arena plans
(``Arena.begin_step``) for a step of the size its caller expects (what the tensors the last
backward released took dense, say), within that size less what the arenas still leased hold
beyond what their live tensors would take dense (``Arena.excess_words``). Where the new step
is as large as expected and its tensors fit, all the buffers together then take no more than
their tensors would dense.

A step that begins while nothing is alive once steps have overlapped (a pipeline's warmup:
several forwards before the first backward) is planned as its arena's history says, for all
of its forwards, unless that arena's steps keep more than half their dense size stored
(``WARMUP_SHARE``): its buffer, filled by the first forward and part of the next, would then
outlast the first forward's tensors holding more than the rest stored in it take dense, and
the steps after it would pay for that excess by storing less. It is planned for one
overlapping step instead, and keeps the later forwards' tensors dense.
"""

from __future__ import annotations

import torch

from bitsparse.allocator.arena import Arena

WARMUP_SHARE = 0.5
"""Where steps overlap, a step that begins while nothing is alive (a pipeline's warmup) whose
arena's steps take more than this share of their dense size stored is planned for one
overlapping step (see ``ArenaPool.begin_step``)."""


class ArenaPool:
    """The arenas of ``device``; ``current`` serves the step in progress.

    Args:
        device: the device of the arenas.
        window: the arenas' window (see ``Arena``).
        spill: whether the primary arena spills to host memory (see ``Arena``) while steps
            have not overlapped; the others never do.
    """

    def __init__(self, device: torch.device | str, *, window: int | None = 1, spill: bool = False):
        self.primary = Arena(device)
        self.arenas: list[Arena] = [self.primary]
        """Every arena of the device, the primary first."""
        self.current = self.primary
        self.overlapped = False
        """Whether a step began while tensors of an earlier one were alive."""
        self._overlapping_words: int | None = None
        """The dense words the last such step was expected to take."""
        self.configure(window, spill)

    def configure(self, window: int | None, spill: bool) -> None:
        """Set the current arena's ``window`` and, for the primary before steps overlapped,
        ``spill`` (see ``Arena``); only while it is not leased."""
        current = self.current
        current.window, current.spill = window, spill and current is self.primary and not self.overlapped

    def begin_step(self, demand: tuple, expected_words: int | None = None) -> None:
        """Note ``demand``, the finished step's (``Arena.begin_step``'s first four arguments),
        in the arena that served it, and serve the new step with a free arena (see above),
        emptied and planned for a step of ``expected_words`` dense words, within them less
        the leased arenas' excess (None: not known; the arena plans from its own history
        alone, or, for a warmup once steps overlapped, for one overlapping step: see above).
        What a caller prepared for an arena's buffer is stale where another arena serves the
        steps (``current``) or the arena's buffer (``values``) changed.
        """
        served = self.current
        leased = [arena for arena in self.arenas if arena.leased]
        if leased:
            self.overlapped, self.primary.spill = True, False
        free = [arena for arena in self.arenas if arena not in leased]
        chosen = self.primary if self.primary in free else served if served in free else next(iter(free), None)
        plan = {"expected_words": expected_words, "budget_words": None}
        if expected_words is not None:
            plan["budget_words"] = max(0, expected_words - sum(arena.excess_words for arena in leased))
            self._overlapping_words = expected_words
        elif self.overlapped and chosen is not None and (chosen.stored_share or 0) > WARMUP_SHARE:
            # A warmup (several forwards, nothing alive before them): planned for all of them,
            # its buffer would outlast the first forward's tensors, with more than the tensors
            # the rest stored in it take dense, and the steps after it would pay for that.
            plan["expected_words"] = self._overlapping_words
        if chosen is served:
            served.begin_step(*demand, **plan)
        else:
            served.begin_step(*demand)  # noted; emptied too if free
            if chosen is None:
                chosen = Arena(served.device, window=self.primary.window, growable=self.primary.growable)
                chosen.plan_like(served)  # its history, the step just noted included
            chosen.begin_step(None, None, **plan)
        if chosen not in self.arenas:
            self.arenas.append(chosen)  # one statement: an exception (Ctrl-C) before it drops the arena whole
        for arena in free:
            if arena is not chosen and arena.values is not None:
                arena.release_buffer()
        self.current = chosen

    @property
    def open_leases(self) -> int:
        """The open leases of all the arenas."""
        return sum(arena.open_leases for arena in self.arenas)

    @property
    def reserved_bytes(self) -> int:
        """All the device memory the arenas hold."""
        return sum(arena.reserved_bytes for arena in self.arenas)

    @property
    def spill_bytes(self) -> int:
        """All the host memory the arenas hold (the primary's spill region)."""
        return sum(arena.spill_bytes for arena in self.arenas)
