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
would a saved tensor, in the layout inductor gives a saved tensor
(``compiled_ops.register_lowerings``, ``_saved_strides``; a tensor whose strides inductor may
pad is kept, ``_padded_by_inductor``).
Eager autograd calls the same two objects as plain hooks, which go straight to the eager path
(``Session.pack``/``unpack``).

A selected tensor's store and restore are the ops of ``hooks.compiled_ops``, which hand it
to the session: it is compressed into the device's arena exactly as in eager mode (measured
when there is no room, confirmed asynchronously, leases, statistics), and the graph saves
only a key to its handle. Compiled code writes over a buffer once past its last use (inductor
reuses buffers and computes in place), so a handle that keeps a tensor dense, until the arena
confirms that its values fit or for good where they do not, keeps a copy of it
(``Session.store_compiled``); a tensor the arena is sure to fit (every one of a steady step,
with the spill region) is read by its encoder before any later kernel of the graph, in stream
order, and nothing of it is kept.

Besides inductor's post-grad passes (``hooks.graph_passes``: the fused store of a ReLU output
and its square, the fused restore and backward of the square, and each op's place in the
graph), two things steer the compiler:

- The partitioner decides what a compiled forward saves; left alone, for ``fc2(relu(fc1(x))
  ** 2)`` it saves the dense pre-activation and the square and recomputes the ReLU. ``steer``
  is a joint-graph pass (``torch._functorch.config.joint_custom_pass``) that marks each
  ReLU-family node that would be compressed ``MUST_SAVE`` and the squares of it
  ``PREFER_RECOMPUTE``, the tags selective activation checkpointing gives the partitioner: the
  ReLU output is saved, and compressed, and its square is recomputed from it; only where that
  changes no value of the graph (``held_in_memory``, ``only_read_from_memory``, a ReLU input
  read by nothing else, a ReLU output the backward reads: ``_read_by_backward``), and not in
  a region the user checkpoints.
- The backward is compiled together with the forward (``force_non_lazy_backward_lowering``),
  while the passes are installed, rather than at its first run, outside ``compressing()``.

``steer_compiles`` sets these, the post-grad passes and, before PyTorch 2.14, the mend of
inductor's scheduler (``graph_passes.recompute_keeping_mutations``) for each compile that
begins under BitSparse's hooks, and only for it (``torch._dynamo.callback``'s compile
callbacks).
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from types import SimpleNamespace

import torch
from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
from torch.utils.checkpoint import CheckpointPolicy

from bitsparse.compressed import MAX_NUMEL
from bitsparse.format import SUPPORTED_DTYPES
from bitsparse.hooks.compiled_ops import installed_hooks, register_lowerings
from bitsparse.hooks.graph_passes import (
    held_in_memory,
    is_view,
    only_read_from_memory,
    post_grad_passes,
    recompute_keeping_mutations,
    viewed,
)
from bitsparse.hooks.options import Options
from bitsparse.hooks.provenance import RELU, SQUARE, Provenance, classify_fx_node, fx_kind

_hook_pairs: dict[tuple, tuple] = {}
"""The hook pair of each (session, selection options, excluded sites): the same objects every
time, so that a compiled graph, which guards on them, is not compiled again. Kept for good (a
few objects per selection a program uses): Dynamo guards on the hooks' ids, which a new
object could take over from a dead one, running a graph compiled for another pair."""
MAX_OPTION_SETS = 256
"""Run-time option sets a pack hook keeps its screen for; forgotten all at once past this."""
_numbers = itertools.count()
_FILLS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("full", "full_like", "zeros", "zeros_like", "ones", "ones_like", "scalar_tensor")
    + ("empty", "empty_like", "empty_strided", "new_full", "new_zeros", "new_ones", "new_empty")
)
"""Ops whose output reads no tensor's values; such a tensor is kept as it is. A graph saved
one where the joint graph shared a forward's zeros with the backward (``torch.where(t > 0, t,
0)`` beside an indexing, whose backward scatters into zeros). Stored, it was restored into a
buffer of the backward's own, which inductor scattered into in place, computing the kernel
around it in two passes with a rounding between them that the graph without BitSparse, which
copies the saved zeros it receives before scattering, does not make."""
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
            installed_hooks[self._number], self.options = (self._session, options), options


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
    size, ReLU-family by the shared rule (or any, with ``select="all"``, but a fill:
    ``_FILLS``), of a site that pays."""
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
    if getattr(node.target, "overloadpacket", None) in _FILLS:
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
    register_lowerings()
    undo = getattr(_steering, "undo", None)
    if undo is not None:
        _steer_inductor(undo)
    if functorch_config.activation_memory_budget < 1:
        return graph_module
    forward = _forward_nodes(graph_module.graph)
    for node in graph_module.graph.nodes:
        if "recompute" in node.meta:
            continue  # in a region the user checkpoints, whose plan stands
        kind = fx_kind(node)
        if (
            kind == RELU
            and selected(node, options, excluded)
            and held_in_memory(node.args[0])
            and len(node.args[0].users) == 1  # else the backward fuses its recomputation with them
            and _read_by_backward(node, forward)
        ):
            value = node.meta["val"]
            if _padded_by_inductor(graph_module.graph, value, value.stride()):
                continue
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        elif (
            kind == SQUARE
            and classify_fx_node(node) is Provenance.RELU
            and _squares_a_saved_relu(node)
            and only_read_from_memory(node)
        ):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    return graph_module


def _squares_a_saved_relu(square: torch.fx.Node) -> bool:
    """Whether ``square`` squares (a view of) a ReLU output tagged ``MUST_SAVE`` above: only
    then is it recomputed from what the graph saves anyway. A square of a ReLU left to the
    partitioner (of a cast, say) it would recompute from further back, and what inductor
    fuses in the backward changes with it: the bf16 sums of a weight's gradient differed."""
    return viewed(square.args[0]).meta.get("recompute") is CheckpointPolicy.MUST_SAVE


def _forward_nodes(joint: torch.fx.Graph) -> set:
    """The nodes of a joint graph that the forward's outputs need: the ancestors of the
    outputs that depend on no tangent (the gradient of an output). Every other node computes
    the backward, or something only the backward needs (the partitioner places it there)."""
    backward = set()
    for node in joint.nodes:
        if (node.op == "placeholder" and "tangents" in str(node.target)) or any(
            arg in backward for arg in node.all_input_nodes
        ):
            backward.add(node)
    pending = [node for node in joint.output_node().all_input_nodes if node not in backward]
    forward = set()
    while pending:
        node = pending.pop()
        if node not in forward:
            forward.add(node)
            pending.extend(node.all_input_nodes)
    return forward


def _read_by_backward(node: torch.fx.Node, forward: set) -> bool:
    """Whether a node outside ``forward`` reads ``node``'s value itself, or a view of it:
    only then does ``MUST_SAVE`` make the partitioner save it. Where the backward only needs
    values computed from it, the tag bans computing it again, and the partitioner saves those
    values instead, rounded to their dtype, where without BitSparse inductor may compute them
    again in float32 within the kernel that uses them: the gradients would change."""
    return any(
        user.op != "output" and (user not in forward or (is_view(user) and _read_by_backward(user, forward)))
        for user in node.users
    )


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
    ``place_ops`` after the post-grad passes (and after any such pass already set), and before
    PyTorch 2.14 its scheduler's fix that keeps a restore before the kernels reading what it
    wrote (``graph_passes.recompute_keeping_mutations``); what is changed is noted in ``undo``."""
    config = sys.modules.get("torch._inductor.config")
    if config is None:
        return
    passes = post_grad_passes()
    if not isinstance(config.post_grad_custom_post_pass, passes):
        _assign(config, {"post_grad_custom_post_pass": passes(config.post_grad_custom_post_pass)}, undo)
    if torch.__version__ < (2, 14):
        from torch._inductor.scheduler import SchedulerNode

        if hasattr(SchedulerNode, "recompute_size_and_body"):
            _assign(SchedulerNode, {"recompute_size_and_body": recompute_keeping_mutations()}, undo)


def _assign(config, values: dict, undo: list) -> None:
    for name, value in values.items():
        before = getattr(config, name)
        if before is not value:
            undo.append((config, name, before))
            setattr(config, name, value)
