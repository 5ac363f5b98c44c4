"""An index of tensor spans: which recorded span of a storage holds a given tensor's elements.

Marks (``bitsparse.mark``) and stored tensors (a storage saved again, or a view of it) ask the
same question of a saved tensor: does a span recorded earlier, in the same storage, of the
same dtype and at the same version, contain all of its elements?
"""

from __future__ import annotations

import weakref

import torch


def span_end(t: torch.Tensor) -> int:
    """One past the last storage element ``t`` touches."""
    if t.is_contiguous():
        return t.storage_offset() + t.numel()
    if t.numel() == 0:
        return t.storage_offset()
    return t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)


def span_of(t: torch.Tensor, dense_numel: int | None = None) -> tuple:
    """``(address, start, end, dtype, version)``: the address of ``t``'s storage, the storage
    elements from ``start`` to ``end`` that ``t`` touches, its dtype and its version, read
    once for the lookups of one saved tensor. ``dense_numel``: ``t``'s element count, when
    the caller knows that ``t`` is dense (contiguous in some order of its dims, as
    channels-last tensors are), so that its span is that many elements (host time)."""
    start = t.storage_offset()
    end = start + dense_numel if dense_numel is not None else span_end(t)
    # The storage's address without making a storage object (host time).
    return t.data_ptr() - start * t.element_size(), start, end, t.dtype, t._version


class SpanIndex:
    """Values recorded for spans of storages, found again by any tensor inside a span.

    An entry holds its value and its owner, an object that keeps the storage alive, weakly:
    an entry whose owner or value was dropped never matches, so neither does a storage freed
    and its address reused. The entries at one address are all of one storage (``add`` drops
    the others). Not thread-safe: callers hold their own lock.
    """

    def __init__(self):
        self._entries: dict[int, list[tuple]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, span: tuple, value: weakref.ref, owner: weakref.ref) -> None:
        """Record the object ``value`` refers to for ``span`` (``span_of`` a tensor) for as
        long as the one ``owner`` refers to lives: the storage, or a tensor over it (which
        costs less host time to refer to). References, which the callers share with their
        other tables (host time)."""
        address, start, end, dtype, version = span
        entry = (owner, value, start, end, dtype, version)
        entries = self._entries.get(address)
        # Live owners at one address share its storage: live storages do not overlap.
        if entries is None or entries[0][0]() is None:
            self._entries[address] = [entry]
        else:
            entries.append(entry)

    def find(self, span: tuple) -> object | None:
        """The value of a live entry whose span contains ``span`` (``span_of`` a tensor),
        unchanged since (same dtype and version); None if there is none."""
        address, start, end, dtype, version = span
        entries = self._entries.get(address)
        if not entries:
            return None
        if entries[0][0]() is None:
            # Its owner was freed: the caching allocator hands its address to the next tensor
            # of the same size, which is what most lookups here meet.
            del self._entries[address]
            return None
        for owner, value, entry_start, entry_end, entry_dtype, entry_version in entries:
            if entry_start <= start and end <= entry_end and entry_dtype == dtype and entry_version == version:
                found = value()
                if found is not None and owner() is not None:
                    return found
        return None

    def prune(self) -> None:
        """Drop the entries whose storage or value is gone."""
        live = {k: [e for e in v if e[0]() is not None and e[1]() is not None] for k, v in self._entries.items()}
        self._entries = {k: v for k, v in live.items() if v}

    def clear(self) -> None:
        self._entries.clear()
