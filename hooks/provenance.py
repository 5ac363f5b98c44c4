"""Which tensors are ReLU-family outputs, learned from the ops as they run (no data is read).

``grad_fn`` alone misses common models (an in-place ReLU on a view hides its node inside
``CopySlices``), so a ``TorchFunctionMode`` watches the ops that guarantee nonnegative results
(relu, threshold and clamp with nonnegative bounds, hardtanh/relu6 with min >= 0) and squares
of their outputs, and records each result by storage, element span and version counter.
A saved tensor is recognised when it lies inside a recorded span of the same storage at the
same version; views share their base's version counter, so views are recognised too.

While such an op runs, the tensor it saves for backward is its result (relu saves its
output), which the mode has not recorded yet: ``in_flight`` answers for that case.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MAX_STORAGES = 4096
"""Records are pruned of dead tensors when they cover more storages than this."""


@dataclass(eq=False)
class Record:
    """A recorded nonnegative tensor: its span, version and, for squares, the squared source.

    ``storage_ref`` is a weak reference to the storage: while it is alive, the address
    cannot have been reused, so a tensor at that address and version is the recorded one.
    ``stored`` is filled in by whoever stores the tensor (a weak reference to its handle and
    the storage offset it was stored from), so that a square can later find its source even
    after the source's own storage is gone.
    """

    storage_ref: weakref.ref
    storage: int
    offset: int
    numel: int
    dtype: torch.dtype
    version: int
    shape: torch.Size
    stride: tuple[int, ...]
    square_of: "Record | None" = None
    stored: tuple | None = None

    def covers(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies inside this record's span, unchanged since it was recorded."""
        if self.storage_ref() is None or t.dtype != self.dtype or t._version != self.version:
            return False
        return self.offset <= t.storage_offset() and span_end(t) <= self.offset + self.numel

    @property
    def contiguous(self) -> bool:
        expected, step = [], 1
        for n in reversed(self.shape):
            expected.append(step)
            step *= max(n, 1)
        return self.numel == self.shape.numel() and all(
            s == e for s, e, n in zip(self.stride, reversed(expected), self.shape) if n > 1
        )


def span_end(t: torch.Tensor) -> int:
    """One past the last storage element ``t`` touches."""
    if t.numel() == 0:
        return t.storage_offset()
    return t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)


def _nonnegative(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _arg(args, kwargs, index: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _always(args, kwargs) -> bool:
    return True


def _threshold(args, kwargs) -> bool:
    return _nonnegative(_arg(args, kwargs, 1, "threshold")) and _nonnegative(_arg(args, kwargs, 2, "value"))


def _clamp(args, kwargs) -> bool:
    return _nonnegative(_arg(args, kwargs, 1, "min"))


def _hardtanh(args, kwargs) -> bool:
    return _nonnegative(_arg(args, kwargs, 1, "min_val", -1.0))


def _exponent_two(args, kwargs) -> bool:
    exponent = _arg(args, kwargs, 1, "exponent")
    return isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and exponent == 2


def _same_operand(args, kwargs) -> bool:
    other = _arg(args, kwargs, 1, "other")
    return isinstance(other, torch.Tensor) and other is args[0]


def _inplace_flag(args, kwargs, index: int) -> bool:
    return bool(_arg(args, kwargs, index, "inplace", False))


# func -> (condition on the arguments, is it a square, is it in place (or a function of args))
_NONNEG_OPS = {
    torch.relu: (_always, False, False),
    torch.relu_: (_always, False, True),
    torch.Tensor.relu: (_always, False, False),
    torch.Tensor.relu_: (_always, False, True),
    F.relu: (_always, False, lambda a, k: _inplace_flag(a, k, 1)),
    F.relu_: (_always, False, True),
    torch.threshold: (_threshold, False, False),
    torch.threshold_: (_threshold, False, True),
    F.threshold: (_threshold, False, lambda a, k: _inplace_flag(a, k, 3)),
    F.threshold_: (_threshold, False, True),
    torch.clamp: (_clamp, False, False),
    torch.clip: (_clamp, False, False),
    torch.clamp_min: (_clamp, False, False),
    torch.Tensor.clamp: (_clamp, False, False),
    torch.Tensor.clip: (_clamp, False, False),
    torch.Tensor.clamp_min: (_clamp, False, False),
    torch.Tensor.clamp_: (_clamp, False, True),
    torch.Tensor.clip_: (_clamp, False, True),
    torch.Tensor.clamp_min_: (_clamp, False, True),
    F.hardtanh: (_hardtanh, False, lambda a, k: _inplace_flag(a, k, 3)),
    F.hardtanh_: (_hardtanh, False, True),
    F.relu6: (_always, False, lambda a, k: _inplace_flag(a, k, 1)),
    torch.square: (_always, True, False),
    torch.Tensor.square: (_always, True, False),
    torch.Tensor.square_: (_always, True, True),
    torch.pow: (_exponent_two, True, False),
    torch.Tensor.pow: (_exponent_two, True, False),
    torch.Tensor.__pow__: (_exponent_two, True, False),
    torch.Tensor.pow_: (_exponent_two, True, True),
    torch.mul: (_same_operand, True, False),
    torch.Tensor.mul: (_same_operand, True, False),
    torch.Tensor.__mul__: (_same_operand, True, False),
    torch.Tensor.mul_: (_same_operand, True, True),
}


class ProvenanceTracker(TorchFunctionMode):
    """Records the results of nonnegative-producing ops while active (a TorchFunctionMode)."""

    def __init__(self):
        super().__init__()
        self._records: dict[int, list[Record]] = {}
        self._threads = threading.local()  # the ops in flight are per thread

    @property
    def _in_flight(self) -> list[tuple[torch.Tensor, bool]]:
        stack = getattr(self._threads, "in_flight", None)
        if stack is None:
            stack = self._threads.in_flight = []
        return stack

    # -- queries --------------------------------------------------------------------------

    def lookup(self, t: torch.Tensor) -> Record | None:
        """The record covering ``t``, if ``t`` is (a view of) a recorded nonnegative tensor."""
        if t.is_inference():  # no version counter: nothing can be recorded for it
            return None
        records = self._records.get(t.untyped_storage().data_ptr())
        if records:
            for record in reversed(records):
                if record.covers(t):
                    return record
        return None

    def in_flight(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is the result of the nonnegative op running now (saved by that op)."""
        if not self._in_flight:
            return False
        first_input, inplace = self._in_flight[-1]
        shares_input = t.untyped_storage().data_ptr() == first_input.untyped_storage().data_ptr()
        return shares_input if inplace else not shares_input

    def clear(self) -> None:
        self._records.clear()

    def _prune(self) -> None:
        """Drop the records of tensors that no longer exist."""
        live = {k: [r for r in v if r.storage_ref() is not None] for k, v in self._records.items()}
        self._records = {k: v for k, v in live.items() if v}

    # -- recording ------------------------------------------------------------------------

    def mark(self, t: torch.Tensor) -> None:
        """Record ``t`` as nonnegative (``bitsparse.mark``)."""
        self._record(t, None)

    def _record(self, t: torch.Tensor, square_of: Record | None) -> None:
        if not t.is_floating_point() or t.is_inference():
            return
        if len(self._records) > MAX_STORAGES:
            self._prune()
        untyped = t.untyped_storage()
        storage = untyped.data_ptr()
        records = [r for r in self._records.get(storage, ()) if r.storage_ref() is not None]
        records.append(
            Record(
                storage_ref=weakref.ref(untyped),
                storage=storage,
                offset=t.storage_offset(),
                numel=span_end(t) - t.storage_offset(),
                dtype=t.dtype,
                version=t._version,
                shape=t.shape,
                stride=t.stride(),
                square_of=square_of,
            )
        )
        self._records[storage] = records

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = _NONNEG_OPS.get(func)
        if rule is None or not args or not isinstance(args[0], torch.Tensor):
            return func(*args, **kwargs)
        condition, is_square, inplace = rule
        if callable(inplace):
            inplace = inplace(args, kwargs)
        if not condition(args, kwargs):
            return func(*args, **kwargs)
        source = self.lookup(args[0]) if is_square else None
        if is_square and source is None:
            return func(*args, **kwargs)  # a square of anything else has no exact zeros
        self._in_flight.append((args[0], inplace))
        try:
            result = func(*args, **kwargs)
        finally:
            self._in_flight.pop()
        if isinstance(result, torch.Tensor):
            # An in-place square overwrote its source, so it can only be stored, not recomputed.
            recomputable = is_square and not inplace and source.contiguous and result.is_contiguous()
            self._record(result, source if recomputable else None)
        return result
