"""The inductor post-grad passes that fuse and place the ops of ``hooks.compiled_ops`` in a
compiled graph, and what they know of how inductor computes.

- ``fuse_relu_squares``: a ReLU output that the forward only squares besides storing it
  (``fc2(relu(fc1(x)) ** 2)``) is stored by one op that reads the ReLU's input and writes the
  square: the forward writes no ReLU output and reads no tensor twice, as without BitSparse.
- ``fuse_relu_square_backwards``: a restored ReLU output that the backward only squares and
  differentiates through its square is restored by one op that takes the square's gradient
  and writes the square and the ReLU input's gradient (on CUDA): nothing writes the ReLU
  output or reads it back.
- ``place_ops``: each store right after its tensor, each restore right before its first use
  (AOTAutograd traces them at the forward's end and the backward's start).

Each fused op writes what inductor's own kernels would, bit for bit, and only where every
reader reads it from memory (``only_read_from_memory``, ``held_in_memory``); every other
store and restore is left as it is. ``post_grad_passes`` runs the three after the passes the
configuration held before. ``recompute_keeping_mutations`` mends a PyTorch before 2.14 whose
scheduler could run a kernel before the restore that fills what it reads.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch

from bitsparse.codecs import SQUARE_DTYPES
from bitsparse.hooks import compiled_ops
from bitsparse.hooks.provenance import SQUARE, fx_kind

_RESHAPES = ("view", "reshape", "_unsafe_view")
"""Ops whose output, for a contiguous input, holds the input's elements in the same order."""

_VIEWS = (*_RESHAPES, "permute", "t", "transpose")


def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node``'s output is a view of its input: what reads it reads the input's memory."""
    return getattr(node.target, "_opname", None) in _VIEWS


def viewed(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose output ``node``'s is a view of, through any chain of views (``node``
    itself if it is no view)."""
    while is_view(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def only_read_from_memory(node: torch.fx.Node) -> bool:
    """Whether every use of ``node``'s value, through views, reads it from memory: as an
    operand of a matrix product, or as the graph's output.

    A fused op writes a tensor that inductor would compute, and must write what inductor's
    code reads. Inductor computes a low-precision tensor in float32 and rounds it once, when
    it writes it; a consumer it fuses with the producer (a bias gradient's sum, a pointwise
    op) sees the float32 value before that rounding, and a reduction fused with its input's
    producer may sum in another order than one that reads the input (in float32 too). Only a
    consumer that reads the tensor from memory sees what a fused op writes, as it would see
    the graph's own tensor. (Inductor fuses a producer into a matrix product's template only
    where that needs no float32.) The same holds for a square the partitioner would save and
    the backward recomputes instead (``hooks.compiled.steer``)."""
    aten = torch.ops.aten
    for user in node.users:
        if user.op == "output" or user.target in (aten.mm.default, aten.bmm.default):
            continue
        if user.target is aten.addmm.default and user.args[0] is not node:
            continue
        if is_view(user) and only_read_from_memory(user):
            continue
        return False
    return True


def held_in_memory(node) -> bool:
    """Whether inductor's code reads ``node``'s value from memory wherever it is used, rounded
    to its dtype, whatever the graph saves: a graph input or a matrix product's output (an
    extern kernel's), through views. Any other op's value a kernel may compute again in
    float32 where it uses it, so that a fused op, which reads the rounded value, would see
    another value than the graph's own kernel; and what inductor fuses with it changes with
    what is saved (``hooks.compiled.steer``)."""
    aten = torch.ops.aten
    node = viewed(node)
    return node.op == "placeholder" or node.target in (aten.mm.default, aten.addmm.default, aten.bmm.default)


def fuse_relu_squares(graph: torch.fx.Graph) -> None:
    """Replace each ``store`` of a ReLU output that the forward only squares (besides saving
    it) by a ``store_relu_square`` of the ReLU's input, which stores the ReLU output and
    writes the square in one pass (the codecs' ``relu_square``).

    For ``proj(relu(fc(x)) ** 2)``, inductor computes the ReLU and its square in one kernel
    that reads the pre-activation and writes both, and the store reads the ReLU output again:
    beyond what the model itself needs, a tensor the size of the pre-activation is written and
    read once more. Fused, the pre-activation is read once and the square written once, as
    without BitSparse. The ReLU and the square are the ones inductor computes (``+0.0`` below zero,
    other values' bits kept; the square in float32, rounded to nearest even), so the forward
    and the gradients are those of the graph without BitSparse, bit for bit.

    Only the plain form is fused: ``relu``, then reshapes, then the saved tensor, which has
    no other user than its square and the store; the square read from memory only (by matrix
    products, see ``only_read_from_memory``); every tensor contiguous, of one dtype whose
    square the codecs write, and computed in float32 by inductor's generated code (its
    default). Every other store is left as it is.
    """
    for store in list(graph.find_nodes(op="call_function", target=torch.ops.bitsparse.store.default)):
        path = _relu_to_saved(store.args[0])
        if path is None or tuple(store.args[3]) != tuple(path[-1].meta["val"].stride()):
            continue
        saved = path[-1]
        square = next(user for user in saved.users if user is not store)
        with graph.inserting_before(square):
            source = path[0].args[0]  # the ReLU's input, reshaped as the saved tensor was
            for view in path[1:]:
                source = graph.node_copy(view, lambda arg, old=view.args[0], new=source: new if arg is old else arg)
            fused = graph.call_function(torch.ops.bitsparse.store_relu_square.default, (source, *store.args[1:3]))
            key = graph.call_function(operator.getitem, (fused, 0))
            squared = graph.call_function(operator.getitem, (fused, 1))
        fused.meta["val"] = (store.meta["val"], square.meta["val"])
        key.meta["val"], squared.meta["val"] = store.meta["val"], square.meta["val"]
        square.replace_all_uses_with(squared)
        store.replace_all_uses_with(key)
        for node in (square, store, *reversed(path)):
            graph.erase_node(node)


def _relu_to_saved(saved: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes from a ``relu`` to ``saved`` (the ReLU, reshapes, ``saved``) if the ReLU's
    output is only reshaped into ``saved``, and ``saved`` only stored and squared, in the
    form ``fuse_relu_squares`` fuses; None otherwise."""
    path = [saved]
    while getattr(path[0].target, "_opname", None) in _RESHAPES and isinstance(path[0].args[0], torch.fx.Node):
        path.insert(0, path[0].args[0])
    relu = path[0]
    if relu.target is not torch.ops.aten.relu.default or any(len(node.users) != 1 for node in path[:-1]):
        return None
    squares = [user for user in saved.users if user.target is not torch.ops.bitsparse.store.default]
    if len(saved.users) != 2 or len(squares) != 1 or fx_kind(squares[0]) != SQUARE:
        return None
    square = squares[0]
    values = [node.meta.get("val") for node in (relu.args[0], *path, square)]
    if not all(isinstance(v, torch.Tensor) and v.dtype == values[0].dtype and v.is_contiguous() for v in values):
        return None
    if values[0].dtype not in SQUARE_DTYPES or values[-1].shape != saved.meta["val"].shape:
        return None
    if not (_squares_in_float32(values[0]) and held_in_memory(relu.args[0]) and only_read_from_memory(square)):
        return None
    return path


def _squares_in_float32(value: torch.Tensor) -> bool:
    """Whether inductor's code for ``value``'s device computes a square of its dtype in
    float32, rounded once, as the codecs do (on CUDA, unless configured otherwise)."""
    if value.dtype == torch.float32 or value.device.type != "cuda":
        return True
    from torch._inductor import config

    return getattr(config.triton, "codegen_upcast_to_fp32", False)


FUSED_BACKWARD_DEVICES = ("cuda",)
"""The device types whose compiled backwards ``fuse_relu_square_backwards`` fuses. On CUDA a
product with a NaN operand is the one canonical NaN, in inductor's code and the decoder's
alike. On the CPU, where an element of a ReLU output and its gradient are both NaNs, which
of the two payloads their product keeps depends on the order a compiler gave the operands,
in inductor's generated code and in PyTorch's kernels: the fused backward could differ from
the graph's in that NaN's bits, so the CPU keeps the graph's own kernel."""


def fuse_relu_square_backwards(graph: torch.fx.Graph) -> None:
    """Replace each ``restore_into`` of a ReLU output whose backward is that of its square by
    a ``restore_relu_square_backward``, which writes the square and the gradient of the
    ReLU's input as it decodes (the codecs' ``square_grad``).

    The backward of ``proj(relu(fc(x)) ** 2)`` squares the restored ReLU output ``r`` for
    ``proj``'s weight gradient and computes ``where(r <= 0, 0, grad * (r * 2))`` for ``fc``'s,
    ``grad`` being the square's gradient: inductor fuses both into one kernel that reads ``r``
    and ``grad``, and the decoder writes ``r`` before it. Fused, ``r`` is neither written nor
    read: a tensor the size of the pre-activation less each way. The arithmetic is inductor's
    (in float32, rounded once; the codecs' ``relu_square_backward``), so the gradients are
    those of the graph without BitSparse, bit for bit.

    Only that form is fused: ``r`` used by ``r ** 2``, by ``r ** 1.0 * 2`` times the gradient
    (then reshaped), and by ``r <= 0`` to mask that product with zeros, and by nothing else;
    the square and the masked product read from memory only (by matrix products, see
    ``only_read_from_memory``: a bias's gradient, a sum of the masked product, is computed
    by inductor from unrounded values, so a layer with a bias keeps the plain restore);
    every tensor contiguous, of one dtype the codecs square, computed in float32 by
    inductor's code, on a device of ``FUSED_BACKWARD_DEVICES``. Every other restore is left as
    it is. The fused op goes before the first use of what it writes; where the gradient comes
    later, what needs the op follows it (inductor's stable topological sort).
    """
    from torch._inductor.pattern_matcher import stable_topological_sort

    position = {node: i for i, node in enumerate(graph.nodes)}
    unsorted = False
    for restore in list(graph.find_nodes(op="call_function", target=torch.ops.higher_order.auto_functionalized_v2)):
        match = _relu_square_backward_of(restore)
        if match is None:
            continue
        square, masked, grad, dead = match
        uses = [use for node in (square, masked) for use in node.users]
        if not uses:
            continue
        first = min(uses, key=position.__getitem__)
        unsorted |= position.get(grad, -1) >= position[first]
        buffer = restore.kwargs["_all_bases"][0]  # of the restored tensor's shape and strides
        with graph.inserting_before(first):
            buffers = [graph.call_function(buffer.target, buffer.args, buffer.kwargs) for _ in range(2)]
            kwargs = {"key": restore.kwargs["key"], "square_grad": grad, "_all_bases": buffers}
            kwargs.update(_square_base_index=0, _grad_input_base_index=1)
            fused = graph.call_function(
                restore.target, (torch.ops.bitsparse.restore_relu_square_backward.default,), kwargs
            )
            outputs = [graph.call_function(operator.getitem, (fused, index)) for index in (1, 2)]
        values = [torch.empty_like(buffer.meta["val"]) for _ in range(2)]
        for node, value in zip((*buffers, *outputs), (*values, *values)):
            node.meta["val"] = value
        fused.meta["val"] = (None, *values)
        square.replace_all_uses_with(outputs[0])
        masked.replace_all_uses_with(outputs[1])
        for node in (masked, *dead):
            graph.erase_node(node)
    if unsorted:
        stable_topological_sort(graph)


def _relu_square_backward_of(restore: torch.fx.Node) -> tuple | None:
    """For a ``restore_into`` whose output the backward only uses as ``fuse_relu_square_backwards``
    fuses: the square, the masked gradient, the square's gradient (unreshaped) and the other
    nodes that the fused op makes dead (the restore among them), in an order they can be
    erased in. None otherwise."""
    aten = torch.ops.aten
    if restore.args[0] is not torch.ops.bitsparse.restore_into.default:
        return None
    if set(restore.kwargs) != {"key", "_out_base_index", "_all_bases"}:  # ``out`` a view of its buffer
        return None
    unused = [output for output in restore.users if not output.users]
    used = [output for output in restore.users if output.users]
    if len(used) != 1 or used[0].target is not operator.getitem:
        return None
    (restored,) = used

    def use(target, scalar):
        found = [user for user in restored.users if user.target is target and user.args == (restored, scalar)]
        return found[0] if len(found) == 1 else None

    square, identity = use(aten.pow.Tensor_Scalar, 2), use(aten.pow.Tensor_Scalar, 1)
    at_most_zero = use(aten.le.Scalar, 0)
    if len(restored.users) != 3 or None in (square, identity, at_most_zero) or len(at_most_zero.users) != 1:
        return None
    doubled = _only_user(identity)
    if doubled is None or (doubled.target, doubled.args) != (aten.mul.Scalar, (identity, 2.0)):
        return None
    product = _only_user(doubled)
    if product is None or product.target is not aten.mul.Tensor or len(product.args) != 2:
        return None
    grad = product.args[1] if product.args[0] is doubled else product.args[0]
    if not isinstance(grad, torch.fx.Node) or grad is doubled:
        return None
    chain = [product]  # the product, then its reshapes
    masked = _only_user(product)
    while masked is not None and getattr(masked.target, "_opname", None) in _RESHAPES:
        chain.append(masked)
        masked = _only_user(masked)
    if masked is None or masked.target is not aten.where.self or masked.args[0] is not at_most_zero:
        return None
    zero = masked.args[1]
    if masked.args[2] is not chain[-1] or not (isinstance(zero, torch.fx.Node) and _is_zero(zero)):
        return None
    reshapes, exclusive = [], True  # the gradient's reshapes that only lead to the product die with it
    while getattr(grad.target, "_opname", None) in _RESHAPES and isinstance(grad.args[0], torch.fx.Node):
        exclusive = exclusive and len(grad.users) == 1
        reshapes += [grad] if exclusive else []
        grad = grad.args[0]  # reshapes keep the elements' order, which is all the op reads
    values = [node.meta.get("val") for node in (restored, grad, product, square, masked)]
    if not all(isinstance(v, torch.Tensor) and v.is_contiguous() for v in values):
        return None
    shape, dtype = values[0].shape, values[0].dtype
    if any(v.dtype != dtype for v in values) or dtype not in SQUARE_DTYPES or not _squares_in_float32(values[0]):
        return None
    if values[0].device.type not in FUSED_BACKWARD_DEVICES:
        return None
    if any(v.shape != shape for v in values[2:]) or values[1].numel() != values[0].numel():
        return None
    if not (held_in_memory(grad) and only_read_from_memory(square) and only_read_from_memory(masked)):
        return None
    dead = [*reversed(chain), *reshapes, doubled, identity, at_most_zero, *([zero] if len(zero.users) == 1 else [])]
    buffers = [node for node in restore.kwargs["_all_bases"] if len(node.users) == 1]
    return square, masked, grad, [*dead, square, restored, *unused, restore, *buffers]


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_zero(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a scalar ``+0.0`` (``aten.full([], 0.0)``)."""
    return node.target is torch.ops.aten.full.default and node.args[0] == [] and node.args[1] == 0


def place_ops(graph: torch.fx.Graph) -> None:
    """Move each ``store`` to right after the tensor it stores, and each ``restore_into``
    (with its buffer) to right before the first use of what it restores, or before the ops
    that lead up to it where inductor may fuse them with that use (``_fusible``): a restore
    amid them would split the kernel inductor makes of them, which then sums in another order.

    AOTAutograd traces the packs at the end of the forward and the unpacks at the start of
    the backward. Inductor follows that order: it would compute a ReLU that it fused into its
    square again at the end, from the pre-activation kept alive until then, and decode every
    stored tensor before the backward's first op, holding them all from its start."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.target is torch.ops.bitsparse.store.default:
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and source.op == "call_function":
                source.append(node)
        elif _is_restore(node):
            _move_before_first_use(graph, node, position)


def _is_restore(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a functionalized ``restore_into`` (as inductor's post-grad graphs
    hold mutating ops)."""
    higher_order = torch.ops.higher_order
    functionalized = (
        getattr(higher_order, "auto_functionalized", None),
        getattr(higher_order, "auto_functionalized_v2", None),
    )
    return node.target in functionalized and node.args[0] is torch.ops.bitsparse.restore_into.default


def _move_before_first_use(graph: torch.fx.Graph, restore: torch.fx.Node, position: dict) -> None:
    outputs = list(restore.users)
    if not all(output.target is operator.getitem for output in outputs):
        return  # a form this pass does not know: left where it is
    for output in outputs:
        if not output.users:
            graph.erase_node(output)
    outputs = [output for output in outputs if output.users]
    uses = [use for output in outputs for use in output.users]
    if not uses:
        return
    first = min(uses, key=position.__getitem__)
    while _fusible(first.prev):
        first = first.prev
    buffers = [
        node for node in restore.all_input_nodes
        if node.target is torch.ops.aten.empty_strided.default and len(node.users) == 1
    ]  # fmt: skip
    for node in (*buffers, restore, *outputs):
        first.prepend(node)


_EXTERN = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward")
"""Ops inductor calls as they are (or as templates), between which it fuses the others."""


def _fusible(node: torch.fx.Node) -> bool:
    """Whether inductor may fuse ``node`` with the ops around it: an op of aten or prims that
    it lowers to kernels of its own, not one it calls (a matrix product, a convolution, a
    fallback kernel), nor another library's op."""
    from torch._inductor.lowering import fallbacks, needs_realized_inputs

    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace not in ("aten", "prims") or target._opname in _EXTERN:
        return False
    return target not in fallbacks and target not in needs_realized_inputs


@functools.cache
def recompute_keeping_mutations() -> Callable[..., None]:
    """Inductor's ``SchedulerNode.recompute_size_and_body`` as PyTorch 2.14 has it. Before 2.14
    its CPU backend, recomputing a node's loops to fuse it with another, read the node's
    dependencies again from its loops and forgot that a buffer it reads was written in place
    before (pytorch/pytorch#185509, unless the node also had an ordering-only dependency): the
    scheduler could then run the node before the write. Each restore writes into a buffer in
    place (``restore_into``), so a kernel could read the buffer before the restore had filled
    it: memory of whatever was there before, and wrong gradients."""
    from torch._inductor.scheduler import SchedulerNode

    recompute = SchedulerNode.recompute_size_and_body

    def recompute_size_and_body(self, *args, **kwargs):
        recompute(self, *args, **kwargs)
        if self.mutation_renames:  # renaming twice changes nothing: the new names are final
            self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    return recompute_size_and_body


@functools.cache
def post_grad_passes() -> type:
    """The class of inductor post-grad passes that run ``fuse_relu_squares``,
    ``fuse_relu_square_backwards`` and ``place_ops`` after the pass or passes they were made
    with (what the configuration held before)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class BitSparsePasses(CustomGraphPass):
        def __init__(self, previous):
            if previous is None:
                previous = ()
            self.previous = tuple(previous) if isinstance(previous, (list, tuple)) else (previous,)

        def __call__(self, graph: torch.fx.Graph) -> None:
            for run in self.previous:
                run(graph)
            fuse_relu_squares(graph)
            fuse_relu_square_backwards(graph)
            place_ops(graph)

        def uuid(self):
            # Inductor caches compiled graphs under this key: None (no caching) unless every
            # pass has one.
            ids = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.previous)
            files = get_hash_for_files((__file__, compiled_ops.__file__))
            return None if None in ids else (files, FUSED_BACKWARD_DEVICES, *ids)

    return BitSparsePasses
