"""BitSparse inside ``torch.compile``: the saved-tensor hooks as graphs AOTAutograd inlines.

AOTAutograd inlines saved-tensor hooks into a compiled forward and backward when both hooks
are ``torch.fx.GraphModule``s: for each tensor the forward saves, it traces the pack hook into
the forward's epilogue and the unpack hook into the backward's prologue (a private mechanism of
``torch._functorch._aot_autograd.graph_compile``; this module is the only place that relies on
it). While it traces them, ``_get_saved_tensor_hook_context()`` names the saved FX node, so the
choice of what to compress is made once, at compile time, by the same rule as in eager mode
(``provenance.classify_fx_node``): a selected tensor's pack becomes a ``bitsparse::store`` op,
its unpack a ``bitsparse::restore_into`` op, and every other saved tensor passes through
untouched, with no Python at run time. Inductor writes what a store stores to memory as it
would a saved tensor, in the layout inductor gives a saved tensor (``_register_lowerings``,
``_saved_strides``; a tensor whose strides inductor may pad is kept, ``_padded_by_inductor``).
Eager autograd calls the same two objects as plain hooks, which go straight to the eager path
(``Session.pack``/``unpack``).

The ops are Python functions registered with the dispatcher, which inductor's generated Python
code calls directly (``_write_direct_call``): ``store`` hands the tensor to the session, which
compresses it into the device's arena exactly as in eager mode (measured when there is no
room, confirmed asynchronously, leases, statistics) and returns a *key*, a one-element CPU
tensor naming the handle; ``restore_into`` decodes the handle the key names
into a buffer the backward graph allocated. The compiled graph saves only the key, so the
handle lives exactly as long as the graph's saved tensors do. Compiled code writes over a
buffer once past its last use (inductor reuses buffers and computes in place), so a handle
that keeps a tensor dense, until the arena confirms that its values fit or for good where they
do not, keeps a copy of it (``Session.store_compiled``); a tensor the arena is sure to fit
(every one of a steady step, with the spill region) is read by its encoder before any later
kernel of the graph, in stream order, and nothing of it is kept.

Four passes and a setting steer the compiler:

- The partitioner decides what a compiled forward saves; left alone, for ``fc2(relu(fc1(x))
  ** 2)`` it saves the dense pre-activation and the square and recomputes the ReLU. ``steer``
  is a joint-graph pass (``torch._functorch.config.joint_custom_pass``) that marks each
  ReLU-family node that would be compressed ``MUST_SAVE`` and the squares of it
  ``PREFER_RECOMPUTE``, the tags selective activation checkpointing gives the partitioner: the
  ReLU output is saved, and compressed, and its square is recomputed from it; only where that
  changes no value of the graph (``_held_in_memory``, ``_only_read_from_memory``), and not in
  a region the user checkpoints.
- A ReLU output that the forward only squares besides saving it (``fc2(relu(fc1(x)) ** 2)``)
  is stored by one op that reads the ReLU's input and writes the square
  (``fuse_relu_squares``, a post-grad pass): the forward writes no ReLU output and reads no
  tensor twice, as without BitSparse.
- A restored ReLU output that the backward only squares and differentiates through its
  square is restored by one op that takes the square's gradient and writes the square and the
  ReLU input's gradient (``fuse_relu_square_backwards``, a post-grad pass, on CUDA): nothing
  writes the ReLU output or reads it back.
- Inductor keeps the traced order of the ops: every store at the forward's end, where it would
  compute a ReLU it fused into its square again from the pre-activation, kept alive until
  then, and every restore at the backward's start, which would hold every decoded tensor from
  there. ``place_ops``, a post-grad pass, moves each store to right after its tensor and each
  restore to right before its first use.
- The backward is compiled together with the forward (``force_non_lazy_backward_lowering``),
  while the passes are installed, rather than at its first run, outside ``compressing()``.

``steer_compiles`` sets them for each compile that begins under BitSparse's hooks, and only
for it (``torch._dynamo.callback``'s compile callbacks).
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import threading
from types import SimpleNamespace

import torch
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
from torch.utils.checkpoint import CheckpointPolicy

from bitsparse.codecs import SQUARE_DTYPES
from bitsparse.compressed import MAX_NUMEL
from bitsparse.format import SUPPORTED_DTYPES
from bitsparse.hooks.options import Options
from bitsparse.hooks.provenance import RELU, SQUARE, Provenance, classify_fx_node, fx_kind

_hook_pairs: dict[tuple, tuple] = {}
"""The hook pair of each (session, selection options, excluded sites): the same objects every
time, so that a compiled graph, which guards on them, is not compiled again. Kept for good (a
few objects per selection a program uses): Dynamo guards on the hooks' ids, which a new
object could take over from a dead one, running a graph compiled for another pair."""
_installed: dict[int, tuple] = {}
"""The session and run-time options of each hook pair, by number: the ops take plain values."""
MAX_OPTION_SETS = 256
"""Run-time option sets a pack hook keeps its screen for; forgotten all at once past this."""
_numbers = itertools.count()
_AOT_GRAPH_COMPILE = "torch._functorch._aot_autograd.graph_compile"


def _hook_context() -> dict | None:
    """What AOTAutograd says of the saved tensor whose hooks it is tracing (its FX node), or
    None outside that tracing. Importing the module that knows is slow, and nothing can be
    compiling before it is imported."""
    graph_compile = sys.modules.get(_AOT_GRAPH_COMPILE)
    return None if graph_compile is None else graph_compile._get_saved_tensor_hook_context()


def hooks_for(session, options: Options, excluded: frozenset) -> tuple:
    """The ``(pack, unpack)`` hook pair of ``session`` that selects as ``options`` do
    (``min_numel``, ``select``) and, in compiled graphs, no save site in ``excluded``. Every
    set of options that selects alike gets the same pair, whose graphs then serve them all:
    a block points the pack hook at its own options while it runs (``_PackHook.use``), so
    that changing an option that only matters at run time (``capacity``, ``window``, ...)
    compiles nothing again."""
    key = (id(session), options.min_numel, options.select, excluded)
    pair = _hook_pairs.get(key)
    if pair is None:
        number = next(_numbers)
        pack = _PackHook(session, number, lambda t: _trace_pack(t, number, options, excluded))
        pack.selection = (options, excluded)
        pack.use(options)
        unpack = _Hook(session.unpack, _trace_unpack)
        unpack.screen_with(session.unpack_hook(unpack.route))
        pair = _hook_pairs[key] = (pack, unpack)
    return pair


class _Hook(torch.fx.GraphModule):
    """A saved-tensor hook that is a GraphModule, so that AOTAutograd inlines it: called while
    a compiled graph's hooks are traced, it runs ``traced`` (which records ops); called by
    eager autograd, it runs ``eager`` directly."""

    selection: tuple[Options, frozenset] | None = None
    """The options and excluded sites of a pack hook, which the partitioner's steering reads."""

    def __init__(self, eager, traced):
        graph = torch.fx.Graph()
        graph.output(graph.call_function(traced, (graph.placeholder("x"),)))
        super().__init__(torch.nn.Module(), graph)
        self._eager, self._traced = eager, traced
        # GraphModule gives each instance a class of its own, whose __call__ goes through
        # nn.Module: a hook runs for every saved tensor, so it goes straight here.
        type(self).__call__ = _Hook.route

    def route(self, x):
        """Run ``traced`` or ``eager`` on ``x``, whichever applies."""
        # Eager autograd hands over real tensors, which tracing never does: most calls end here.
        if x.__class__ is torch.Tensor or _hook_context() is None:
            return self._eager(x)
        return self._traced(x)

    def screen_with(self, screen) -> None:
        """Be ``screen`` when called: a function that takes what eager autograd hands this
        hook, handles what it can at once (a pack hook's plain tensors, an unpack hook's packed
        values) and returns ``self.route(x)`` for the rest (saving Python calls per saved
        tensor)."""
        type(self).__call__ = staticmethod(screen)
        _skipped_by_dynamo(screen.__code__)


class _PackHook(_Hook):
    """A pack hook, which stores with the options of the innermost block using it (``use``):
    its eager path (a screen and ``Session.pack``) and its compiled graphs' ops read them."""

    options: Options | None = None
    """The options it stores with now."""

    def __init__(self, session, number: int, traced):
        super().__init__(None, traced)
        self._session, self._number = session, number
        self._by_options: dict[Options, tuple] = {}
        """The screen and eager pack of each set of options used (built once: a block uses
        them at every step)."""

    def use(self, options: Options) -> None:
        """Store with ``options`` (which select as this hook's do) from now on. Hooks are per
        thread but this hook is shared: two threads that use it at once with different
        options store with the last one's, as exactly."""
        if options is not self.options:
            made = self._by_options.get(options)
            if made is None:
                if len(self._by_options) >= MAX_OPTION_SETS:
                    self._by_options.clear()
                session = self._session
                made = self._by_options[options] = (
                    session.pack_hook(options, self.route),
                    functools.partial(session.pack, options),
                )
            screen, self._eager = made
            self.screen_with(screen)
            # Last, in one statement: an exception (Ctrl-C) above leaves ``options`` as it
            # was, and the next use does all of this again.
            _installed[self._number], self.options = (self._session, options), options


def _skipped_by_dynamo(code) -> None:
    """Autograd may call a hook while Dynamo's frame callback is active (an eager op inside a
    frame Dynamo runs without compiling it, such as a compiled LayerNorm module's), and Dynamo
    would then compile the hook and the session's code behind it, with guards on the session's
    counters that fail at every step. Dynamo skips ``code``'s frames and every frame they call,
    at no cost to a hook called without the callback (unlike torch.compiler.disable's wrapper)."""
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


_skipped_by_dynamo(_Hook.route.__code__)


# -- compile time ------------------------------------------------------------------------------


def fx_site(node: torch.fx.Node) -> str:
    """A compiled save site: the producing op, shape, dtype and device of the saved value."""
    value = node.meta["val"]
    return f"compiled {node.target} {tuple(value.shape)} {value.dtype} {value.device}"


def selected(node: torch.fx.Node, options: Options, excluded: frozenset = frozenset()) -> bool:
    """Whether the value of ``node`` is compressed: a floating tensor of a supported dtype and
    size, ReLU-family by the shared rule (or any, with ``select="all"``), of a site that pays."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dtype not in SUPPORTED_DTYPES:
        return False
    if value.layout != torch.strided or value.device.type not in ("cuda", "cpu"):
        return False
    numel = value.numel()
    if isinstance(numel, torch.SymInt):
        # A size that varies says nothing of the runs by the one compiled for (the first, or a
        # small last batch): selected, as any size, and a run too large is kept (``Site``).
        numel = max(options.min_numel, 1)
    if not options.min_numel <= numel <= MAX_NUMEL or numel == 0:
        return False
    if options.select == "relu" and classify_fx_node(node) is not Provenance.RELU:
        return False
    return fx_site(node) not in excluded


def _trace_pack(t: torch.Tensor, number: int, options: Options, excluded: frozenset):
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None and inductor_config.triton.cudagraphs:
        raise RuntimeError(
            "BitSparse does not support CUDA graphs (torch.compile with mode='reduce-overhead' or "
            "mode='max-autotune', or options={'triton.cudagraphs': True}): its arena "
            "and the fallback of tensors it cannot store are managed by the host at every step. Compile "
            "with mode='default' or mode='max-autotune-no-cudagraphs' inside bitsparse.compressing()."
        )
    node = _hook_context()["_node"]
    if not selected(node, options, excluded) or _returned(node):
        return t
    stride = _saved_strides(node, t)
    if _padded_by_inductor(node.graph, t, stride):
        return t
    _steer_late()
    # The size and strides travel with the key: with dynamic shapes they are symbols of the
    # forward, which the backward receives as inputs. Three items: the unpack hook tells this
    # from eager autograd's two (see Session.unpack_hook).
    return (torch.ops.bitsparse.store(t, number, fx_site(node), stride), tuple(t.shape), stride)


def _saved_strides(node: torch.fx.Node, t: torch.Tensor) -> tuple:
    """The strides inductor gives ``node``'s value when the graph saves it, which the stored
    tensor and its restore's buffer take, so that the backward reads the layout it reads
    without BitSparse: channels-last for a dense 4-d tensor that inductor's layout
    optimization prefers so (its rule for a saved tensor), the traced strides otherwise."""
    static = all(isinstance(n, int) for n in (*t.shape, *t.stride()))
    dense = static and (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last))
    if t.dim() == 4 and dense and node in _channels_last_nodes(node.graph):
        _, channels, height, width = t.shape
        return (height * width * channels, 1, width * channels, channels)
    return tuple(t.stride())


def _returned(node: torch.fx.Node) -> bool:
    """Whether the forward returns ``node``'s value as well as saving it (its output lists the
    node twice). Storing it would save no memory, the caller holding it, and inductor lays it
    out with eager's strides rather than a saved tensor's. AOTAutograd's default filter
    (``saved_tensors_hooks_filtering_mode="donated"``) never hands such a tensor to the hooks;
    the other modes do."""
    (outputs,) = node.graph.output_node().args
    return sum(output is node for output in outputs) > 1


def _padded_by_inductor(graph: torch.fx.Graph, value: torch.Tensor, stride: tuple) -> bool:
    """Whether inductor may pad the strides of ``value`` saved with ``stride``: its
    comprehensive padding rounds each stride above ``padding_stride_threshold`` elements up to
    a multiple of ``padding_alignment_bytes`` where a buffer's layout is its to choose (on GPUs,
    not channels-last). The restore's buffer takes its strides when the backward is traced,
    before inductor lays the forward out, so a tensor it may pad is not stored: read with other
    strides, the backward's matrix products may take other kernels (on the H200, a bf16 layer
    of 4000 hidden units with a bias got other gradients). Errs toward True."""
    from torch._inductor import config

    if not config.comprehensive_padding or value.dim() < 2:
        return False
    if config.disable_padding_cpu and not _compiled_for_gpu(graph):
        return False
    if not all(isinstance(n, int) for n in (*value.shape, *stride)):
        return config.pad_dynamic_shapes
    if value.dim() == 4 and not config.pad_channels_last and stride[1] == 1:
        return False
    align = config.padding_alignment_bytes // value.element_size()
    return any(n > config.padding_stride_threshold and n % align for n in stride)


def _compiled_for_gpu(graph: torch.fx.Graph) -> bool:
    """Whether a graph input is on a GPU, which turns inductor's padding on (see
    ``torch._inductor.config.disable_padding_cpu``); worked out once per graph, as
    ``_channels_last_nodes``."""
    cached = graph.__dict__.get("_bitsparse_for_gpu")
    if cached is None:
        values = (placeholder.meta.get("val") for placeholder in graph.find_nodes(op="placeholder"))
        cached = any(isinstance(value, torch.Tensor) and value.device.type != "cpu" for value in values)
        graph.__dict__["_bitsparse_for_gpu"] = cached
    return cached


def _channels_last_nodes(graph: torch.fx.Graph) -> frozenset:
    """The nodes of a forward graph that inductor lays out channels-last where it can
    (``GraphLowering``'s layout optimization, decided for the whole graph)."""
    cached = graph.__dict__.get("_bitsparse_channels_last")
    if cached is None:
        from torch._inductor.graph import GraphLowering

        module = graph.owning_module
        optimized = module is not None and GraphLowering.decide_layout_opt(module, is_inference=False)
        found = GraphLowering.find_nodes_prefer_channels_last(SimpleNamespace(module=module)) if optimized else ()
        cached = graph.__dict__["_bitsparse_channels_last"] = frozenset(found)
    return cached


def _trace_unpack(packed):
    if not isinstance(packed, tuple):
        return packed
    key, size, stride = packed
    value = _hook_context()["_node"].meta["val"]
    # Restored into a buffer of the graph's own, which inductor knows to be aligned (a tensor
    # an op returns, with the key, a CPU tensor, among its inputs, it takes to be unaligned,
    # and it would compile the kernels that read it without vectorized loads).
    out = torch.empty_strided(size, stride, dtype=value.dtype, device=value.device)
    torch.ops.bitsparse.restore_into(key, out)
    return out


def steer(graph_module: torch.fx.GraphModule, inputs) -> torch.fx.GraphModule:
    """Make the partitioner save each ReLU-family tensor the installed hooks compress, and
    recompute its squares from it (see the module's docstring), leaving the tags of the
    user's own checkpointing as they are, and tagging nothing where the user gave the
    partitioner a memory budget (``activation_memory_budget`` below 1), whose plan stands;
    set inductor up to compile the graph (``_steer_inductor``)."""
    import torch._functorch.config as functorch_config

    selection = _innermost_selection()
    if selection is None:
        return graph_module
    options, excluded = selection
    _register_lowerings()
    undo = getattr(_steering, "undo", None)
    if undo is not None:
        _steer_inductor(undo)
    if functorch_config.activation_memory_budget < 1:
        return graph_module
    for node in graph_module.graph.nodes:
        if "recompute" in node.meta:
            continue  # in a region the user checkpoints, whose plan stands
        kind = fx_kind(node)
        if kind == RELU and selected(node, options, excluded) and _held_in_memory(node.args[0]):
            value = node.meta["val"]
            if _padded_by_inductor(graph_module.graph, value, value.stride()):
                continue
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        elif kind == SQUARE and classify_fx_node(node) is Provenance.RELU and _only_read_from_memory(node):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    return graph_module


class _JointPass:
    """``steer`` after the joint-graph pass that was set before it (``previous``)."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, graph_module, inputs):
        if self.previous is not None:
            graph_module = self.previous(graph_module, inputs)
        return steer(graph_module, inputs)


_steering = threading.local()
"""What the compile or block that steers compiles in the thread changed in the compilers'
configuration, as ``(config, name, value before)``, to restore at its end."""


def steer_compiles() -> tuple | None:
    """Steer each compile that begins while BitSparse's hooks are the innermost pair (compiled
    code guards on them, so its compiles happen then): ``steer`` as the joint-graph pass
    (after any pass already there), and the backward compiled with the forward, under the
    hooks, rather than at its first run, outside them. ``steer`` adds ``_steer_inductor``'s
    settings when inductor compiles. Everything set is restored when the compile ends.

    Dynamo's compile callbacks do this for each compile, which costs a block nothing (a block
    that only runs compiled code does not touch the configuration, whose first reads after a
    step took 70 us of host time on the CI's CPU): this returns None once they are registered.
    Until then (Dynamo not loaded yet, or ``torch._dynamo.reset()``, which removes them), it
    registers them if it can and the caller's block steers from now on: give what this
    returns to ``stop_steering`` at its end."""
    if _register_compile_callbacks():
        return None
    return _begin_steering()


def _register_compile_callbacks() -> bool:
    """Register the compile callbacks if Dynamo is loaded; return whether they already were."""
    callbacks = sys.modules.get("torch._dynamo.callback")
    if callbacks is None:
        return False
    handler = callbacks.callback_handler
    if _compile_started in handler.start_callbacks:
        return True
    handler.register_start_callback(_compile_started)
    handler.register_end_callback(_compile_ended)
    return False


def _steer_late() -> None:
    """Steer a compile that is tracing BitSparse's hooks unsteered, as after a
    ``torch._dynamo.reset()`` inside a block (which removed the callbacks the block counted
    on): the partitioner has chosen already, but inductor's passes (``fuse_relu_squares``,
    ``fuse_relu_square_backwards``, ``place_ops``) still fuse the stores and restores and
    place them where they cost least. The end
    callback, registered now, restores the settings when the compile ends (or, for a compile
    without Dynamo, the next compile's start or the block's end)."""
    if getattr(_steering, "undo", None) is None:
        _register_compile_callbacks()
        _steering.compile = _begin_steering()
        _steer_inductor(_steering.undo)


def stop_steering(steering: tuple | None) -> None:
    """End what ``steer_compiles`` began (``steering``, what it returned) at a block's end."""
    _compile_ended()  # what a compile outside Dynamo may have left (see _steer_late)
    _end_steering(steering)


def _end_steering(steering: tuple | None) -> None:
    if steering is not None:
        _steering.undo, undo = steering
        _restore(undo)


def _begin_steering() -> tuple:
    """Steer compiles from now; returns what ``stop_steering`` takes to end it."""
    undo: list = []
    outer = getattr(_steering, "undo", None)
    try:
        _steer_functorch(undo)
        _steering.undo = undo
        return outer, undo
    except BaseException:  # Ctrl-C, say: the caller gets nothing to end, so nothing stays set
        _steering.undo = outer
        _restore(undo)
        raise


def _steer_functorch(undo: list) -> None:
    # Settings are assigned, not patched with ``config.patch``, which builds a class per patch.
    import torch._functorch.config as functorch_config

    values = {}
    if not isinstance(functorch_config.joint_custom_pass, _JointPass):
        values["joint_custom_pass"] = _JointPass(functorch_config.joint_custom_pass)
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):  # place_ops sees the restores
        values["force_non_lazy_backward_lowering"] = True
    _assign(functorch_config, values, undo)


def _restore(undo: list) -> None:
    for config, name, value in reversed(undo):
        setattr(config, name, value)


def _innermost_selection() -> tuple[Options, frozenset] | None:
    """The options and excluded sites of BitSparse's hooks if they are the innermost pair."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if hooks is None else getattr(hooks[0], "selection", None)


def _compile_started(*_) -> None:
    """Dynamo's start callback (for the outermost compile of the moment)."""
    _compile_ended()  # what a compile outside Dynamo may have left (see _steer_late)
    _steering.compile = _begin_steering() if _innermost_selection() is not None else None


def _compile_ended(*_) -> None:
    """Dynamo's end callback."""
    _end_steering(getattr(_steering, "compile", None))
    _steering.compile = None


def _steer_inductor(undo: list) -> None:
    """If inductor compiles: ``fuse_relu_squares``, ``fuse_relu_square_backwards`` and
    ``place_ops`` after the post-grad passes (and after any such pass already set); what is
    changed is noted in ``undo``."""
    config = sys.modules.get("torch._inductor.config")
    if config is None:
        return
    passes = _post_grad_passes()
    if not isinstance(config.post_grad_custom_post_pass, passes):
        _assign(config, {"post_grad_custom_post_pass": passes(config.post_grad_custom_post_pass)}, undo)


def _assign(config, values: dict, undo: list) -> None:
    for name, value in values.items():
        before = getattr(config, name)
        if before is not value:
            undo.append((config, name, before))
            setattr(config, name, value)


_RESHAPES = ("view", "reshape", "_unsafe_view")
"""Ops whose output, for a contiguous input, holds the input's elements in the same order."""

_VIEWS = (*_RESHAPES, "permute", "t", "transpose")
"""Ops whose output is a view of their input: what reads it reads the input's memory."""


def _only_read_from_memory(node: torch.fx.Node) -> bool:
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
    the backward recomputes instead (``steer``)."""
    aten = torch.ops.aten
    for user in node.users:
        if user.op == "output" or user.target in (aten.mm.default, aten.bmm.default):
            continue
        if user.target is aten.addmm.default and user.args[0] is not node:
            continue
        if getattr(user.target, "_opname", None) in _VIEWS and _only_read_from_memory(user):
            continue
        return False
    return True


def _held_in_memory(node) -> bool:
    """Whether inductor's code reads ``node``'s value from memory wherever it is used, rounded
    to its dtype, whatever the graph saves: a graph input or a matrix product's output (an
    extern kernel's), through views. Any other op's value a kernel may compute again in
    float32 where it uses it, so that a fused op, which reads the rounded value, would see
    another value than the graph's own kernel; and what inductor fuses with it changes with
    what is saved (``steer``)."""
    aten = torch.ops.aten
    while getattr(node.target, "_opname", None) in _VIEWS and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
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
    products, see ``_only_read_from_memory``); every tensor contiguous, of one dtype whose
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
    if not (_squares_in_float32(values[0]) and _held_in_memory(relu.args[0]) and _only_read_from_memory(square)):
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
    ``_only_read_from_memory``: a bias's gradient, a sum of the masked product, is computed
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
    if not (_held_in_memory(grad) and _only_read_from_memory(square) and _only_read_from_memory(masked)):
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
    (with its buffer) to right before the first use of what it restores.

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
    buffers = [
        node for node in restore.all_input_nodes
        if node.target is torch.ops.aten.empty_strided.default and len(node.users) == 1
    ]  # fmt: skip
    for node in (*buffers, restore, *outputs):
        first.prepend(node)


@functools.cache
def _post_grad_passes() -> type:
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
            return None if None in ids else (get_hash_for_files((__file__,)), FUSED_BACKWARD_DEVICES, *ids)

    return BitSparsePasses


# -- run time ----------------------------------------------------------------------------------


# The two ops of every stored tensor are defined with the dispatcher's own registration: a
# ``torch.library.custom_op`` wraps its function in Python layers (autograd, alias checks) that
# cost several microseconds of host time per call, twice per stored tensor and step.
_library = torch.library.Library("bitsparse", "FRAGMENT")
_library.define("store(Tensor x, int hooks, str site, SymInt[] stride) -> Tensor", tags=(torch.Tag.flexible_layout,))
_library.define("store_relu_square(Tensor x, int hooks, str site) -> (Tensor, Tensor)")
_library.define("restore_into(Tensor key, Tensor(a!) out) -> ()")
_library.define(
    "restore_relu_square_backward(Tensor key, Tensor square_grad, Tensor(a!) square, Tensor(b!) grad_input) -> ()"
)


def store(x: torch.Tensor, hooks: int, site: str, stride: list[int]) -> torch.Tensor:
    """``bitsparse::store``: store ``x``, a tensor a compiled forward saves, with the options
    of the hook pair numbered ``hooks``; returns the key of its handle. ``x`` has the strides
    ``stride`` (inductor's lowering gives it them), those of the buffer it is restored into."""
    return _stored(x, hooks, site)


def store_relu_square(x: torch.Tensor, hooks: int, site: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``bitsparse::store_relu_square``: store ``relu(x)``, which a compiled forward saves and
    squares, as ``store`` does, and return its key and the square (see ``fuse_relu_squares``)."""
    square = torch.empty_like(x)
    return _stored(x, hooks, site, square), square


def _stored(x: torch.Tensor, hooks: int, site: str, square: torch.Tensor | None = None) -> torch.Tensor:
    """The key of the handle of ``x`` stored by the session of the hook pair numbered ``hooks``:
    a one-element tensor whose value means nothing, carrying the session and the handle as an
    attribute, so that the handle lives exactly as long as the graph keeps the key (PyTorch
    keeps a tensor's Python object, and its attributes, while autograd holds the tensor)."""
    session, options = _installed[hooks]
    key = torch.empty(1, dtype=torch.int64)
    key.bitsparse_handle = (session, session.store_compiled(options, x, site, square))
    return key


def restore_into(key: torch.Tensor, out: torch.Tensor) -> None:
    """``bitsparse::restore_into``: write the tensor whose handle ``key`` names, bit for bit,
    into ``out`` (of its shape, strides and dtype)."""
    session, handle = key.bitsparse_handle
    session.restore_compiled(handle, out)


def restore_relu_square_backward(
    key: torch.Tensor, square_grad: torch.Tensor, square: torch.Tensor, grad_input: torch.Tensor
) -> None:
    """``bitsparse::restore_relu_square_backward``: for the ReLU output ``r`` whose handle
    ``key`` names, write ``r ** 2`` into ``square`` and into ``grad_input`` the gradient of the
    ReLU's input given ``square_grad``, that of ``r ** 2`` (see ``fuse_relu_square_backwards``;
    every tensor contiguous, of ``r``'s dtype and element count)."""
    session, handle = key.bitsparse_handle
    session.restore_compiled(handle, grad_input, square, square_grad)


_FUNCTIONS = {
    "store": store,
    "store_relu_square": store_relu_square,
    "restore_into": restore_into,
    "restore_relu_square_backward": restore_relu_square_backward,
}
for _name, _function in _FUNCTIONS.items():
    _library.impl(_name, _function, "CompositeExplicitAutograd")

# Inductor's Python code calls the ops' functions themselves, by this name (see
# ``_write_direct_call``): through the dispatcher, a store took about 20 us more host time and
# a restore 8-12 us more, on the CI's CPU (scripts/host_path.py --compiled).
torch.ops.bitsparse.functions = SimpleNamespace(**_FUNCTIONS)


def _write_direct_call(name: str, node, writeline) -> None:
    """Write the call of ``node``, inductor's fallback kernel for ``bitsparse::<name>``, into
    the Python code inductor generates, as a call of the op's function: its arguments and
    result are the op's, and only Python values travel (a call through the dispatcher
    converts each of them there and back). Inductor's C++ wrapper calls the op as it would,
    and so does its FX wrapper, which takes no lines of Python."""
    from torch._inductor.codegen.wrapper import ExternKernelAllocLine
    from torch._inductor.ir import NoneLayout
    from torch._inductor.virtualized import V

    if getattr(V.graph, "fx_wrapper", False):
        writeline(ExternKernelAllocLine(V.graph.wrapper_code, node))
        return
    call = f"torch.ops.bitsparse.functions.{name}({', '.join([*node.codegen_args(), *node.codegen_kwargs()])})"
    writeline(call if isinstance(node.layout, NoneLayout) else f"{node.get_name()} = {call}")


@torch.library.register_fake("bitsparse::store", lib=_library)
def _(x, hooks, site, stride):
    return torch.empty(1, dtype=torch.int64)


@torch.library.register_fake("bitsparse::store_relu_square", lib=_library)
def _(x, hooks, site):
    return torch.empty(1, dtype=torch.int64), torch.empty_like(x)


@torch.library.register_fake("bitsparse::restore_into", lib=_library)
def _(key, out):
    return None


@torch.library.register_fake("bitsparse::restore_relu_square_backward", lib=_library)
def _(key, square_grad, square, grad_input):
    return None


@torch.library.custom_op("bitsparse::mark", mutates_args=())
def mark(x: torch.Tensor) -> torch.Tensor:
    """``x``, marked as ReLU-family for the compiled graph it is in (``bitsparse.mark`` in
    traced code). Inductor lowers it to ``x`` itself; elsewhere it copies."""
    return x.clone()


@mark.register_fake
def _(x):
    return torch.empty_like(x)


mark.register_autograd(lambda ctx, grad: grad)


@functools.cache
def _register_lowerings() -> None:
    """Let inductor compile ``bitsparse::mark`` to nothing (its output is its input), compute
    what a ``bitsparse::store`` stores into memory before its other users read it, and call
    the functions of the ops that store and restore directly (``_write_direct_call``).

    Inductor writes each tensor a graph saves into memory as it lowers the op that makes it,
    and the ops it lowers after read the tensor from there, rounded to its dtype; a tensor
    only used within the graph it may compute again, in float32, in each kernel that uses it
    (the sum of a bf16 square, then, adds unrounded squares). A stored tensor's only saved
    user is the store, and ``place_ops`` puts the store right after the tensor: realized
    there, its value in every use is the one it has in the graph without BitSparse."""
    from torch._inductor.ir import ExternKernel
    from torch._inductor.lowering import fallback_handler, register_lowering

    try:
        from torch._inductor.codegen.custom_extern_kernel_codegen import CUSTOM_EXTERN_KERNEL_CODEGEN, CustomCodegen
    except ImportError:  # a PyTorch without it calls the ops through the dispatcher
        pass
    else:
        for name in _FUNCTIONS:
            codegen = CustomCodegen(python=functools.partial(_write_direct_call, name))
            CUSTOM_EXTERN_KERNEL_CODEGEN[f"torch.ops.bitsparse.{name}.default"] = codegen
    register_lowering(torch.ops.bitsparse.mark.default)(lambda x: x)
    fallback = fallback_handler(torch.ops.bitsparse.store.default, add_to_fallback_set=False)

    @register_lowering(torch.ops.bitsparse.store.default, type_promotion_kind=None)
    def _(x, hooks, site, stride):
        x.realize()  # in place: what lowers after reads this buffer
        # The strides of the restore's buffer (the op's tag leaves them to this lowering).
        return fallback(ExternKernel.require_exact_strides(x, stride), hooks, site, stride)
