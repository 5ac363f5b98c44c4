"""Which saved tensors hold ReLU-family values, read from the autograd graph at pack time.

A pack hook sees the saved tensor with its ``grad_fn``: ReLU's saved result shows
``ReluBackward0``, a square shows ``PowBackward0`` (exponent 2) or ``MulBackward0`` with the
same input twice, and views show view nodes whose input leads to the producer. Reading that
costs a few attribute lookups per saved tensor and nothing per op (a ``TorchFunctionMode``
watching every op made the GPT step of docs/benchmarks.md 15% slower with nothing stored).

One common case is hidden: an in-place op on a view (``fc(x).relu_()`` where ``fc`` returns
a view of its 2-D product) appears as ``AsStridedBackward0`` -> ``CopySlices``, which wraps
the op's node out of Python's sight; ``threshold``'s node does not keep its value either.
Such tensors are ``HIDDEN``: worth trying, and the caller keeps compressing a save site only
while it pays. ``mark()`` flags any other tensor.
"""

from __future__ import annotations

import enum
import itertools
import threading
from dataclasses import dataclass

import torch

from bitsparse.hooks.spans import SpanIndex

MAX_MARKED_STORAGES = 4096
"""Marks are pruned of dead tensors when they cover more storages than this."""
MAX_VIEW_DEPTH = 8
"""View nodes followed back from a saved tensor before giving up."""


class Provenance(enum.Enum):
    RELU = "relu"
    """The producing node guarantees ReLU-family values (or the tensor was marked)."""
    HIDDEN = "hidden"
    """Possibly ReLU-family: an in-place op on a view (hidden by CopySlices), or threshold."""


# Nodes whose output holds (a subset of) their input's values, unchanged.
_VALUE_PRESERVING = frozenset(
    {
        "AliasBackward0",
        "AsStridedBackward0",
        "AsStridedBackward1",
        "CloneBackward0",
        "ExpandBackward0",
        "NarrowBackward0",
        "PermuteBackward0",
        "ReshapeAliasBackward0",
        "SelectBackward0",
        "SelectBackward1",
        "SliceBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "SqueezeBackward3",
        "TBackward0",
        "ToCopyBackward0",  # a cast keeps zeros zero and signs nonnegative
        "TransposeBackward0",
        "TransposeBackward1",
        "UnbindBackward0",
        "UnsafeViewBackward0",
        "UnsqueezeBackward0",
        "UnsqueezeBackward1",
        "ViewBackward0",
    }
)


def _nonnegative(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


# What a node type means here: a kind, or a rule that reads the node's saved scalars (not
# its saved tensors: reading one would run the unpack hook, and decode).
_OTHER, _VIEW, _HIDDEN, _RELU, _SQUARE = range(5)
_RULES = {
    "ReluBackward0": _RELU,
    "ClampMinBackward0": lambda node: _RELU if _nonnegative(node._saved_min) else _OTHER,
    "ClampBackward1": lambda node: _RELU if _nonnegative(node._saved_min) else _OTHER,
    "HardtanhBackward0": lambda node: _RELU if _nonnegative(node._saved_min_val) else _OTHER,  # relu6 too
    # CopySlices hides the in-place op on a view; threshold's node does not keep its value.
    "CopySlices": _HIDDEN,
    "ThresholdBackward0": _HIDDEN,
    "PowBackward0": lambda node: _SQUARE if node._saved_exponent == 2 else _OTHER,
    "MulBackward0": lambda node: _SQUARE if _same_edge_twice(node) else _OTHER,
    **dict.fromkeys(_VALUE_PRESERVING, _VIEW),
}
_rule_of_class: dict[type, object] = {}
"""``_RULES`` by node class: every pack looks its saved tensor's node up here."""


def _same_edge_twice(node) -> bool:
    (a, i), (b, j) = node.next_functions
    return a is not None and a is b and i == j


def _kind(node) -> int:
    cls = type(node)
    rule = _rule_of_class.get(cls)
    if rule is None:
        rule = _rule_of_class[cls] = _RULES.get(cls.__name__, _OTHER)
    return rule if rule.__class__ is int else rule(node)


@dataclass(frozen=True)
class Square:
    """How the forward squared a tensor: ``torch.pow(x, exponent)`` (``torch.square`` and
    ``x ** 2`` are ``pow(x, 2)``), or ``torch.mul(x, x)`` when ``exponent`` is None.

    Applying the same op to the same bits reproduces the forward's result bit for bit, NaN
    payloads included; another spelling of the square may not (``x * x`` and ``pow(x, 2)``
    return different NaNs for float16 on the CPU).
    """

    exponent: int | float | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, x) if self.exponent is None else torch.pow(x, self.exponent)


def squared_input(node) -> tuple[tuple, Square] | None:
    """The ``(node, output_nr)`` edge whose value ``node`` squares, and how; or None.

    ``torch.square``, ``** 2`` and ``pow(2)`` are ``PowBackward0`` with exponent 2; ``x * x``
    is ``MulBackward0`` with the same edge twice.
    """
    if node is None or _kind(node) != _SQUARE:
        return None
    square = Square(None) if type(node).__name__ == "MulBackward0" else Square(node._saved_exponent)
    return node.next_functions[0], square


def classify_node(node) -> Provenance | None:
    """The provenance of the values ``node`` outputs, looking back through views and squares
    (the square of a ReLU-family tensor is one too)."""
    for _ in range(MAX_VIEW_DEPTH):
        if node is None:
            return None
        kind = _kind(node)
        if kind == _OTHER:
            return None
        if kind == _RELU:
            return Provenance.RELU
        if kind == _HIDDEN:
            return Provenance.HIDDEN
        node = node.next_functions[0][0]
    return None


_thread_serials = itertools.count()
_thread = threading.local()


def node_key(node, output_nr: int) -> tuple[int, int, int]:
    """Identifies an output of an autograd node without holding the node.

    Nodes cannot be weakly referenced. Their sequence numbers are unique per thread (the
    thread that created them, which is the one packing), and thread identities can be
    reused: the key pairs the sequence number with a serial number given to each thread.
    """
    serial = getattr(_thread, "serial", None)
    if serial is None:
        serial = _thread.serial = next(_thread_serials)
    return serial, node._sequence_nr(), output_nr


class Marks:
    """Tensors flagged with ``bitsparse.mark``, by storage, element span and version.

    A saved tensor lying inside a marked span of the same storage at the same version is
    marked, whatever view of it autograd saved.
    """

    def __init__(self):
        self._spans = SpanIndex()
        self._lock = threading.Lock()

    def mark(self, t: torch.Tensor) -> None:
        if t.is_inference():  # no version counter: it can never be saved for backward
            return
        with self._lock:
            if len(self._spans) > MAX_MARKED_STORAGES:
                self._spans.prune()
            self._spans.add(t, t.untyped_storage())

    def covers(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies inside a marked span, unchanged since it was marked."""
        return bool(len(self._spans)) and self._spans.find(t) is not None

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
