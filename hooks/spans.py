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


def storage_address(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, without making a storage object (host time)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


class SpanIndex:
    """Values recorded for spans of storages, found again by any tensor inside a span.

    An entry holds its storage and its value weakly: a storage freed (and its address
    reused) or a value dropped never matches. The entries at one address are all of one
    storage (``add`` drops the others). Not thread-safe: callers hold their own lock.
    """

    def __init__(self):
        self._entries: dict[int, list[tuple]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, t: torch.Tensor, value: object) -> None:
        """Record ``value`` for the span ``t`` covers, at ``t``'s current version."""
        storage = t.untyped_storage()
        entry = (weakref.ref(storage), weakref.ref(value), t.storage_offset(), span_end(t), t.dtype, t._version)
        address = storage.data_ptr()
        entries = self._entries.get(address)
        if entries is None:
            self._entries[address] = [entry]
            return
        if entries[0][0]() is storage:
            entries.append(entry)
        else:  # a freed storage's: the address is this storage's now
            self._entries[address] = [entry]

    def find(self, t: torch.Tensor) -> object | None:
        """The value of a live span that contains ``t``'s elements, unchanged since (same
        dtype and version); None if there is none."""
        address = storage_address(t)
        entries = self._entries.get(address)
        if not entries:
            return None
        if entries[0][0]() is None:
            # Their storage was freed: the caching allocator hands its address to the next
            # tensor of the same size, which is what most lookups here meet.
            del self._entries[address]
            return None
        offset, end, dtype, version = t.storage_offset(), span_end(t), t.dtype, t._version
        for _, value, start, stop, entry_dtype, entry_version in entries:
            if start <= offset and end <= stop and entry_dtype == dtype and entry_version == version:
                found = value()
                if found is not None:
                    return found
        return None

    def prune(self) -> None:
        """Drop the entries whose storage or value is gone."""
        live = {k: [e for e in v if e[0]() is not None and e[1]() is not None] for k, v in self._entries.items()}
        self._entries = {k: v for k, v in live.items() if v}

    def clear(self) -> None:
        self._entries.clear()
