"""``Stats``, the accounting of one step, and how a step's counters are gathered."""

from __future__ import annotations

import copy
from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields

import torch

from bitsparse.allocator.arena import WORD_BYTES


@dataclass
class Stats:
    """Accounting for one step: the one in progress, or the last finished one.

    A step is one forward pass and its backward: it begins at the first saved tensor after
    a backward, so the forwards of gradient accumulation before one backward form one step.

    Sizes are in bytes. ``dense_bytes`` is what the compressed tensors and the fallbacks
    took dense and ``stored_bytes`` what they take now (masks, tile words and values; a
    fallback counts dense). ``ratio = dense_bytes / stored_bytes``. ``zero_fraction`` is over
    the tensors encoded (the compressed ones, and those whose values did not fit). Each saved
    tensor counts once in ``tensors_seen``: compressed, deduplicated, recomputed, skipped or
    a fallback. Deduplicated and recomputed saves cost nothing.

    ``tensors_skipped`` counts saved tensors kept as they are, by the first reason that
    applies: ``small`` (fewer than ``min_numel`` elements), ``parameter`` (a parameter or a
    view of one), ``not_relu_family`` (``select="relu"`` and neither a ReLU-family producer
    nor a mark), ``dtype``, ``layout_or_device``, ``large`` (more elements than one
    ``compress`` call takes), ``unprofitable_site`` (its save site shrank by less than 20%,
    a tensor still alive elsewhere when backward began counting as not shrunk) and
    ``overlapping_or_gapped`` (no permutation of the dims makes it contiguous).

    ``fallbacks`` counts tensors that were to be compressed and are kept dense, by reason:
    ``arena_full`` (no room left: the arena grows for the next step; on the first step, which
    only measures, every candidate counts here), ``out_of_memory`` (the device had no room
    for the arena planned for the step, which then only measures, as a first step does) and
    ``other_stream`` (saved on another CUDA stream than the step's first stored tensor).

    ``arena_reserved`` is the device memory the arenas hold (all of it counts in a step's
    peak), ``arena_peak`` what of it this step used, ``spill_reserved`` the pinned host
    memory they hold to continue their value regions (``Options.host_spill``),
    ``spilled_bytes`` how much of ``stored_bytes`` this step wrote there, and
    ``window_waits`` how often the host waited for the GPU to confirm a tensor (see
    ``Options.window``). ``tensors_alive`` is how many compressed tensors, of any step,
    autograd still held when ``stats()`` was called.
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
    arena_reserved: int = 0
    arena_peak: int = 0
    spill_reserved: int = 0
    spilled_bytes: int = 0
    window_waits: int = 0
    tensors_alive: int = 0

    @property
    def ratio(self) -> float:
        return self.dense_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_dict(self) -> dict:
        """Every field, and ``ratio``."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["ratio"] = self.ratio
        return d

    def __str__(self) -> str:
        mib = 1 << 20
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(self.tensors_skipped.items())) or "none"
        fallbacks = ", ".join(f"{k} {v}" for k, v in sorted(self.fallbacks.items())) or "none"
        spill = ""
        if self.spill_reserved:
            spill = f" (+{self.spilled_bytes / mib:.1f}/{self.spill_reserved / mib:.1f} MiB in host memory)"
        return (
            f"step {self.step}: {self.tensors_compressed}/{self.tensors_seen} saved tensors compressed "
            f"(+{self.tensors_deduplicated} shared, {self.tensors_recomputed} recomputed), "
            f"{self.dense_bytes / mib:.1f} MiB -> {self.stored_bytes / mib:.1f} MiB "
            f"({self.ratio:.2f}x, {100 * self.zero_fraction:.1f}% zeros), "
            f"arena {self.arena_peak / mib:.1f}/{self.arena_reserved / mib:.1f} MiB{spill}; "
            f"skipped: {skipped}; fallbacks: {fallbacks}"
        )


@dataclass
class Stored:
    """What a step's appends of tensors to compress took: how many fit (compressed), their
    dense bytes and elements, the bytes they take (one that did not fit counts dense), of
    them in host memory, and how many did not fit (kept dense: fallbacks)."""

    tensors: int = 0
    dense_bytes: int = 0
    numel: int = 0
    bytes: int = 0
    spilled_bytes: int = 0
    unfit: int = 0


_SCREENED = ("small", "parameter", "not_relu_family")
"""The reasons of the rule's screen, which no save site decides."""


class StepCollector:
    """Counters of one step, filled in by packs; what its appends took is read from the
    arenas at its end: per save site (``demand``; a ``Site``, keyed by the object, whose hash
    costs less than its name's), what pays and what the next step needs, and what the step
    stored (``stored``)."""

    def __init__(self, step: int):
        self.stats = Stats(step=step)
        # defaultdicts: a step's collector is made at its start, where a Counter took longer.
        self.skipped: defaultdict[str, int] = defaultdict(int)
        self.kept_small = self.kept_parameters = self.kept_unrelated = 0
        """Skipped as ``small``, ``parameter`` and ``not_relu_family`` by the pack hook's first
        screen, which adds to plain ints (cheaper than the dict); ``finish`` adds them in."""
        self.fallbacks: defaultdict[str, int] = defaultdict(int)
        self.nonzeros: dict[object, torch.Tensor] = {}
        """Per arena, the device word its encoders add their stored elements to (its tally)."""
        self.leased = False
        """Whether a tensor of this step was stored in an arena (not only measured)."""
        self.live = 0
        """This step's stored tensors that autograd still holds (their arena leases)."""
        self.holds = False
        """Whether a tensor of this step is held until its arena confirms it (not sure to
        fit): only then do stores poll the arenas' reports."""
        self.outlived: dict[object, int] = {}
        """Per save site, the dense bytes of its stored (or measured) tensors that were still
        alive elsewhere when the step's backward began (``StoredTensor.outlived``): storing
        those freed nothing."""
        self.released_in_backward: list[object] = []
        """The save site of each stored (or measured) tensor released during the backward
        before the step's first unpack (``Session._watch_ended``): alive when the backward
        began, as ``outlived`` counts, but no longer when the first unpack counted."""
        self.appends: list[tuple] = []
        """``(arena, number, site, stored)`` per append of the step (``Arena.submit``'s number;
        ``stored``: compressed, not only measured), read by ``demand`` and ``stored``: what
        the step compressed is counted from them once, at its end, not at each store."""

    def found_candidate(self) -> bool:
        """Whether the rule's screen passed a tensor the step saved: stored, recomputed,
        measured, stored by a compiled graph, or kept by a decision of its save site."""
        return bool(self.stats.tensors_seen) or any(n and r not in _SCREENED for r, n in self.skipped.items())

    def screened_out(self) -> int:
        """Saved tensors the screen judged not ReLU-family (kept as they are)."""
        return self.kept_unrelated + self.skipped.get("not_relu_family", 0)

    def nonzeros_counter(self, arena) -> torch.Tensor:
        """The device word the encoders of this step add their stored elements to, for the
        appends to ``arena`` (keyed by the arena, whose hash costs less than a device's):
        its tally, zeroed at the step's first use (one it comes with, not one more allocation)."""
        counter = self.nonzeros.get(arena)
        if counter is None:
            counter = self.nonzeros[arena] = arena.tally.zero_()
        return counter

    def demand(self) -> dict:
        """What the step's appends took, once the arenas delivered their ends (``drain``), per
        save site (a ``hooks.handles.Site``), measured tensors included: ``[arena, dense bytes
        freed (those of ``outlived`` tensors left out), fixed words, value words, most value
        words]``. Read at every step's start: only these sums (``stored`` is the statistics'
        own)."""
        sites: dict[object, list] = {}
        for arena, site, _, start, end in self._delivered():
            words = end - start
            totals = sites.get(site)
            if totals is None:
                sites[site] = [arena, site.dense_bytes, site.fixed_words, words, site.max_value_words]
            else:
                totals[1] += site.dense_bytes
                totals[2] += site.fixed_words
                totals[3] += words
                totals[4] += site.max_value_words
        outlived = [*self.outlived.items(), *((site, site.dense_bytes) for site in self.released_in_backward)]
        for site, dense_bytes in outlived:
            if site in sites:
                sites[site][1] = max(0, sites[site][1] - dense_bytes)
        return sites

    def _delivered(self):
        """``(arena, site, compressed, start, end)`` of each of the step's appends whose end its
        arena delivered: the value words from ``start`` to ``end`` are its (or would have been,
        past the value region). A report lost to an exception (Ctrl-C) while it was delivered
        is left out."""
        for arena, number, site, compressed in self.appends:
            ends = arena.ends()
            if number < len(ends):
                yield arena, site, compressed, ends[number - 1] if number else 0, ends[number]

    def stored(self) -> Stored:
        """What the step's compressed tensors took, once the arenas delivered their ends."""
        stored = Stored()
        for arena, site, compressed, start, end in self._delivered():
            if not compressed:
                continue
            stored.dense_bytes += site.dense_bytes
            stored.numel += site.numel
            if end <= arena.values_capacity_words:
                stored.tensors += 1
                stored.bytes += WORD_BYTES * (site.fixed_words + end - start)
                stored.spilled_bytes += WORD_BYTES * max(0, end - max(start, arena.device_value_words))
            else:
                stored.bytes += site.dense_bytes
                stored.unfit += 1
        return stored

    def finish(self, tensors_alive: int, arena_reserved: int, spill_reserved: int) -> Stats:
        """The step's statistics; synchronizes once to read the device counters.

        ``tensors_alive``, ``arena_reserved`` and ``spill_reserved`` describe the session
        now, all steps together.
        """
        arenas = {append[0] for append in self.appends}
        for arena in arenas:
            arena.drain()
        s = copy.copy(self.stats)
        stored = self.stored()
        s.tensors_compressed = stored.tensors
        s.dense_bytes += stored.dense_bytes
        s.stored_bytes += stored.bytes
        s.spilled_bytes = stored.spilled_bytes
        skipped = Counter(self.skipped)
        skipped.update(
            {"small": self.kept_small, "parameter": self.kept_parameters, "not_relu_family": self.kept_unrelated}
        )
        s.tensors_skipped = {reason: n for reason, n in skipped.items() if n}
        s.fallbacks = dict(self.fallbacks)
        if stored.unfit:
            s.fallbacks["arena_full"] = s.fallbacks.get("arena_full", 0) + stored.unfit
        s.tensors_seen += sum(s.tensors_skipped.values())
        nonzeros = sum(int(n) for n in self.nonzeros.values())
        s.zero_fraction = 1 - nonzeros / stored.numel if stored.numel else 0.0
        usages = [arena.usage() for arena in arenas]
        s.arena_reserved = arena_reserved
        s.spill_reserved = spill_reserved
        s.arena_peak = sum(u.peak for u in usages)
        s.window_waits = sum(u.window_waits for u in usages)
        s.tensors_alive = tensors_alive
        return s
