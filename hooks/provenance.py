"""Which saved tensors hold ReLU-family values, read from the graph that produced them.

One rule decides, for the two graphs a saved tensor can come from: the autograd graph of
eager mode (the saved tensor's ``grad_fn``, read at pack time) and the FX graph of a compiled
forward (the saved node, read when the graph is compiled). The rule is keyed by the op's name:
``relu`` yields ReLU-family values; ``clamp_min``, ``clamp`` and ``hardtanh`` (also ``relu6``)
do with a nonnegative lower bound, and a nonnegative upper bound alone (``clamp_max``) keeps
what its input is; ``threshold`` does with a nonnegative threshold and a value
of 0; a square (``pow`` with exponent 2, ``mul`` of a tensor by itself) of a ReLU-family tensor
is one; a product with a ReLU-family factor is ReLU-family where every other factor is
nonnegative (a dropout mask, a positive scale), and worth trying where a factor's sign is not
known (a ReGLU's ``relu(g(x)) * u(x)``: zero where the ReLU is, but -0.0, to the format a value
like any other, where ``u(x)`` is negative); dropout keeps what its input is; and views and
casts are looked through. Reading that costs a few attribute lookups per saved tensor and
nothing per op (a ``TorchFunctionMode`` watching every op made the GPT step of
docs/benchmarks.md 15% slower with nothing stored).

Autograd hides two cases that an FX graph shows: an in-place op on a view (``fc(x).relu_()``
where ``fc`` returns a view of its 2-D product) appears as ``AsStridedBackward0`` ->
``CopySlices``, which wraps the op's node out of Python's sight, and ``threshold``'s node does
not keep its value. Such tensors are ``HIDDEN``: worth trying, and the caller keeps
compressing a save site only while it pays. ``mark()`` flags any other tensor.
"""

from __future__ import annotations

import enum
import operator
import threading
import weakref
from dataclasses import dataclass

import torch

from bitsparse.hooks.spans import SpanIndex, span_of

MAX_MARKED_STORAGES = 4096
"""Marks are pruned of dead tensors when they cover more storages than this."""
MAX_VIEW_DEPTH = 8
"""View nodes followed back from a saved tensor before giving up."""


class Provenance(enum.Enum):
    RELU = "relu"
    """The producing op guarantees ReLU-family values (or the tensor was marked)."""
    HIDDEN = "hidden"
    """Possibly ReLU-family: an in-place op on a view (hidden by CopySlices), or threshold."""


# -- the rule, by op name ------------------------------------------------------------------

OTHER, VIEW, HIDDEN, RELU, SQUARE, PRODUCT = range(6)
"""What an op means here."""
_MISSING = object()
"""A scalar the graph does not keep (autograd's threshold node drops its value)."""


def _nonnegative(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _floor(name: str):
    """ReLU-family when the op's lower bound ``name`` is nonnegative."""
    return lambda node, graph: RELU if _nonnegative(graph.scalar(node, name)) else OTHER


def _clamp(node, graph) -> int:
    """ReLU-family with a nonnegative lower bound; without one, what a nonnegative upper bound
    leaves of its input (see ``_ceiling``)."""
    low = graph.scalar(node, "min")
    if low is None:
        return _ceiling(node, graph)
    return RELU if _nonnegative(low) else OTHER


def _ceiling(node, graph) -> int:
    """A nonnegative upper bound keeps a ReLU-family input's zeros zero and its values
    nonnegative: what the input is (``relu6`` is ``clamp_max(clamp_min(x, 0), 6)`` in a
    compiled graph)."""
    return VIEW if _nonnegative(graph.scalar(node, "max")) else OTHER


def _threshold(node, graph) -> int:
    value = graph.scalar(node, "value")
    if value is _MISSING:
        return HIDDEN
    return RELU if _nonnegative(graph.scalar(node, "threshold")) and value == 0 else OTHER


def _pow(node, graph) -> int:
    return SQUARE if graph.scalar(node, "exponent") == 2 else OTHER


def _mul(node, graph) -> int:
    return SQUARE if graph.same_input_twice(node) else PRODUCT


def _getitem(node, graph) -> int:
    """An output of an op with several (FX graphs only): a part of a split, or dropout's
    values; dropout's second output is its mask, which says nothing of its input."""
    source, index = node.args[0], node.args[1]
    return OTHER if index != 0 and getattr(source.target, "_opname", None) == "native_dropout" else VIEW


# Ops whose output holds (a subset of) their input's values, unchanged (a cast keeps zeros zero
# and signs nonnegative).
_VIEW_OPS = (
    "alias", "as_strided", "clone", "expand", "narrow", "permute", "reshape", "select", "slice", "split",
    "split_with_sizes", "squeeze", "t", "transpose", "unbind", "unsqueeze", "view", "_unsafe_view", "_to_copy",
    "convert_element_type", "_reshape_alias", "detach",
)  # fmt: skip
OP_RULES = {
    "relu": RELU,
    "clamp_min": _floor("min"),
    "clamp": _clamp,
    "clamp_max": _ceiling,
    "hardtanh": _floor("min_val"),
    "threshold": _threshold,
    "pow": _pow,
    "mul": _mul,
    "copy_slices": HIDDEN,  # autograd's wrapper of an in-place op on a view
    "mark": RELU,  # bitsparse.mark in a compiled graph (hooks/compiled_ops.py)
    # Zeros some values and scales the others by 1 / (1 - p), which is positive.
    "native_dropout": VIEW,
    "getitem": _getitem,
    **dict.fromkeys(_VIEW_OPS, VIEW),
}
"""The rule: an op's name to what it means, or to a function of the node and its graph."""


def _classify(node, graph, depth: int = MAX_VIEW_DEPTH) -> Provenance | None:
    """The provenance of the values ``node`` outputs, looking back through views and squares
    (the square of a ReLU-family tensor is one too) and into the factors of products, at most
    ``depth`` nodes deep along each path."""
    for remaining in range(depth, 0, -1):
        if node is None:
            return None
        kind = graph.kind(node)
        if kind == OTHER:
            return None
        if kind == RELU:
            return Provenance.RELU
        if kind == HIDDEN:
            return Provenance.HIDDEN
        if kind == PRODUCT:
            return _product(node, graph, remaining - 1)
        node = graph.input(node)
    return None


def _product(node, graph, depth: int) -> Provenance | None:
    """The provenance of a product: None without a ReLU-family factor; ``RELU`` when every
    other factor is one too or known to be nonnegative; else ``HIDDEN`` (zero wherever a
    ReLU-family factor is, but of either sign)."""
    family, proven = False, True
    for factor, nonnegative in graph.factors(node):
        provenance = None if factor is None else _classify(factor, graph, depth)
        if provenance is not None:
            family = True
            proven = proven and provenance is Provenance.RELU
        elif not nonnegative:
            proven = False
    if not family:
        return None
    return Provenance.RELU if proven else Provenance.HIDDEN


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


# -- autograd graphs -------------------------------------------------------------------------

_AUTOGRAD_OPS = {
    "ReluBackward0": "relu",
    "ClampMinBackward0": "clamp_min",
    "ClampBackward1": "clamp",
    "ClampMaxBackward0": "clamp_max",
    "HardtanhBackward0": "hardtanh",
    "ThresholdBackward0": "threshold",
    "PowBackward0": "pow",
    "MulBackward0": "mul",
    "NativeDropoutBackward0": "native_dropout",
    "CopySlices": "copy_slices",
    **dict.fromkeys(
        (
            "AliasBackward0", "AsStridedBackward0", "AsStridedBackward1", "CloneBackward0", "ExpandBackward0",
            "NarrowBackward0", "PermuteBackward0", "ReshapeAliasBackward0", "SelectBackward0", "SelectBackward1",
            "SliceBackward0", "SplitBackward0", "SplitWithSizesBackward0", "SqueezeBackward0", "SqueezeBackward1",
            "SqueezeBackward2", "SqueezeBackward3", "TBackward0", "ToCopyBackward0", "TransposeBackward0",
            "TransposeBackward1", "UnbindBackward0", "UnsafeViewBackward0", "UnsqueezeBackward0",
            "UnsqueezeBackward1", "ViewBackward0",
        ),
        "view",
    ),  # fmt: skip
}
"""Autograd node classes by the op whose backward they are."""


class _Autograd:
    """How the rule reads an autograd node: its saved scalars (never its saved tensors:
    reading one would run the unpack hook, and decode) and its first input edge."""

    _rules: dict[type, object] = {}
    """The rule by node class: every pack looks its saved tensor's node up here."""

    @classmethod
    def kind(cls, node) -> int:
        rule = cls._rules.get(node.__class__)
        if rule is None:
            rule = cls._rules[node.__class__] = OP_RULES.get(_AUTOGRAD_OPS.get(type(node).__name__), OTHER)
            if rule == OTHER:
                UNRELATED_NODES.add(node.__class__)
            elif rule == RELU:
                RELU_NODES.add(node.__class__)
        return rule if rule.__class__ is int else rule(node, cls)

    @staticmethod
    def scalar(node, name: str):
        return getattr(node, "_saved_" + name, _MISSING)

    @staticmethod
    def same_input_twice(node) -> bool:
        (a, i), (b, j) = node.next_functions
        return a is not None and a is b and i == j

    @staticmethod
    def input(node):
        return node.next_functions[0][0]

    @staticmethod
    def factors(node):
        """A product's factors, and whether each is known to be nonnegative: an edge's node
        (None for a factor without gradient, a constant or mask, whose values the node does
        not show, and for one made by an op the rule never selects, which a pack then need
        not look into: products are common, an RMSNorm's output one)."""
        (first, _), (second, _) = node.next_functions  # a product of two tensors
        unrelated = UNRELATED_NODES
        return (
            (None if first.__class__ in unrelated else first, False),
            (None if second.__class__ in unrelated else second, False),
        )


UNRELATED_NODES: set[type] = set()
"""The autograd node classes seen so far whose outputs the rule never selects, whatever
their inputs (most saved tensors come from such ops): a pack that finds its tensor's node
class here knows ``classify_node`` would return None, at the cost of a set lookup."""
RELU_NODES: set[type] = set()
"""Likewise, the autograd node classes seen so far whose outputs the rule always selects
(``ReluBackward0``): ``classify_node`` would return ``Provenance.RELU``, and they are no squares."""


def classify_node(node) -> Provenance | None:
    """The provenance of the values an autograd node outputs (a saved tensor's ``grad_fn``)."""
    return _classify(node, _Autograd)


def squared_operand(node) -> tuple[object, Square] | None:
    """What the autograd ``node`` saved of the tensor it squares, and how it squared it; or
    None if it is not a square (or squares two saved values that differ).

    ``torch.square``, ``** 2`` and ``pow(2)`` are ``PowBackward0`` with exponent 2; ``x * x``
    is ``MulBackward0`` with the same edge twice. The saved value is read as the pack hook
    returned it, without unpacking it (which would decode): under BitSparse's hooks, the
    handle of the very values the forward squared.
    """
    if node is None or _Autograd.kind(node) != SQUARE:
        return None
    saved = node._raw_saved_self.data
    if type(node).__name__ != "MulBackward0":
        return saved, Square(node._saved_exponent)
    return (saved, Square(None)) if node._raw_saved_other.data is saved else None


def product_operands(node) -> tuple[object, object] | None:
    """What the autograd ``node`` of a product of two tensors (``MulBackward0``, not a square)
    saved of its factors, as the pack hook returned them (without unpacking, as in
    ``squared_operand``); None for another node, or where it did not save both (a factor
    without gradient: the node needs only the other)."""
    if node is None or _Autograd.kind(node) != PRODUCT:
        return None
    first, second = node._raw_saved_self.data, node._raw_saved_other.data
    return None if first is None or second is None else (first, second)


# -- FX graphs -------------------------------------------------------------------------------


class _FX:
    """How the rule reads a node of an FX graph of ATen ops (a compiled forward)."""

    @staticmethod
    def kind(node) -> int:
        if node.op != "call_function":
            return OTHER
        name = "getitem" if node.target is operator.getitem else getattr(node.target, "_opname", None)
        rule = OP_RULES.get(name, OTHER)
        return rule if rule.__class__ is int else rule(node, _FX)

    @staticmethod
    def scalar(node, name: str):
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            return _MISSING
        if name in node.kwargs:
            return node.kwargs[name]
        for i, argument in enumerate(schema.arguments):
            if argument.name == name:
                if i < len(node.args):
                    return node.args[i]
                return argument.default_value if argument.has_default_value() else _MISSING
        return _MISSING

    @staticmethod
    def same_input_twice(node) -> bool:
        return len(node.args) >= 2 and isinstance(node.args[0], torch.fx.Node) and node.args[0] is node.args[1]

    @staticmethod
    def input(node):
        return node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None

    @staticmethod
    def factors(node):
        """A product's factors, and whether each is known to be nonnegative: a node (a boolean
        mask is) or a number (None in place of the node)."""
        factors = []
        for factor in node.args[:2]:
            if isinstance(factor, torch.fx.Node):
                value = factor.meta.get("val")
                factors.append((factor, isinstance(value, torch.Tensor) and value.dtype == torch.bool))
            else:
                factors.append((None, _nonnegative(factor)))
        return factors


def classify_fx_node(node: torch.fx.Node) -> Provenance | None:
    """The provenance of the values an FX node of ATen ops outputs."""
    return _classify(node, _FX)


def fx_kind(node: torch.fx.Node) -> int:
    """What an FX node's op means to the rule (``OTHER``, ``VIEW``, ``RELU``, ``SQUARE``...)."""
    return _FX.kind(node)


class Marks:
    """Tensors flagged with ``bitsparse.mark``, by storage, element span and version.

    A saved tensor lying inside a marked span of the same storage at the same version is
    marked, whatever view of it autograd saved.
    """

    def __init__(self):
        self._spans = SpanIndex()
        self._lock = threading.Lock()
        self.any = False
        """Whether any tensor is marked (read before ``covers``, for every saved tensor)."""

    def mark(self, t: torch.Tensor) -> None:
        if t.is_inference():  # no version counter: it can never be saved for backward
            return
        with self._lock:
            if len(self._spans) > MAX_MARKED_STORAGES:
                self._spans.prune()
            storage = weakref.ref(t.untyped_storage())
            self._spans.add(span_of(t), storage, storage)
            self.any = True

    def covers(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies inside a marked span, unchanged since it was marked."""
        return self._spans.find(span_of(t)) is not None

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self.any = False
