"""The training API: store ReLU-family activations compressed while autograd keeps them.

``compressing()`` wraps a forward pass; ``enable()`` does the same for the calling thread
until ``disable()``. Both install a ``torch.autograd.graph.saved_tensors_hooks`` pair whose
pack hook reads from each saved tensor's ``grad_fn`` whether a ReLU-family op produced it, and
which ``torch.compile`` inlines into compiled graphs (``bitsparse.hooks.compiled``).
Tensors are compressed into an arena of their device, restored bit for bit in backward, and
the arena is reused as soon as the step's graph is freed (steps that overlap, as in pipeline
schedules, are each served by an arena of their own).
"""

from __future__ import annotations

import threading

import torch

from bitsparse.hooks.compiled import hooks_for, steer_compiles, stop_steering
from bitsparse.hooks.manager import Session
from bitsparse.hooks.options import DEFAULT_MIN_NUMEL, Options
from bitsparse.hooks.stats import Stats

_session = Session()
_local = threading.local()


def _entries() -> list:
    """The ``_Entry`` of each ``compressing()`` block (and ``enable()``) in effect in this
    thread, innermost last: per thread and per entry, so that one block object may be
    entered again inside itself, or by several threads, and blocks may end in any order."""
    entries = getattr(_local, "entries", None)
    if entries is None:
        entries = _local.entries = []
    return entries


def _depth() -> int:
    """``compressing()`` blocks and ``enable()`` in effect in this thread."""
    return len(_entries())


class _Entry:
    """What one entry of a block did: its compile steering, and whether it pushed its hooks."""

    __slots__ = ("block", "steering", "pushed")

    def __init__(self, block: "compressing"):
        self.block, self.steering, self.pushed = block, None, False


class compressing(torch.autograd.graph.saved_tensors_hooks):
    """Context manager under which the activations saved for backward are stored compressed.

    Saved tensors that ReLU-family ops produced (relu, relu6, threshold/clamp/hardtanh with
    a nonnegative lower bound, in place or not, and squares of these), or that ``mark``
    flagged, are stored as a bitmask and their nonzero values in a per-device arena, and
    restored bit for bit when backward needs them. Everything else is kept as it is.
    Gradients are identical to a run without ``compressing()``.

    The arena follows demand: the first step only measures what it would store (every
    candidate is kept dense, so that step peaks no higher than without BitSparse), and from
    the next step on the arena has room for what the last step needed plus 15%.

    Example::

        >>> with bitsparse.compressing():
        ...     h = torch.relu(fc1(x))    # saved for relu's and fc2's backward: compressed
        ...     y = fc2(h)                # x and fc2.weight are saved as they are
        >>> y.sum().backward()            # h is decoded here, bit for bit
        >>> print(bitsparse.stats())      # what the step stored

    Args (keyword only; see ``bitsparse.Options`` for each one's semantics):
        capacity: "auto" (default), bytes (int >= 4096) or a fraction of free memory.
        sign_pack: drop the sign bit of ReLU-family values (15-bit bfloat16).
        min_numel: smaller tensors are kept as they are.
        select: "relu" (default) or "all".
        backend: "torch", "triton" or None (Triton on CUDA).
        window: most compressed tensors held dense until the host sees them fit (those
            the arena is not sure of room for); None: as many as the step saves room for.
        recompute_squares: restore the square of a stored ReLU output from it, and a product
            of either with a tensor that autograd keeps anyway (a ReGLU's, a ReLU²-GLU's)
            from both (in compiled graphs the partitioner is steered to recompute squares,
            whatever this says).
        host_spill: on CUDA, continue the arena in pinned host memory, so that no tensor
            waits for the GPU to confirm it fits.

    Raises:
        TypeError, ValueError: an option of the wrong type or value, or a backend that cannot
            run here (raised when the block is created, before the forward runs).

    Notes:
        Hooks are thread-local and the innermost pair wins: inside a non-reentrant
        ``torch.utils.checkpoint`` region, checkpointing's own hooks apply, so only the
        region's inputs reach BitSparse. ``torch.func`` transforms that differentiate
        (``grad``, ``vjp``, ``jacrev``, ``hessian``) refuse to run while any saved-tensor
        hooks are installed: call them outside the block (or after ``disable()``).
        Code compiled with ``torch.compile`` compresses inside its graphs (compiled once per
        ``min_numel`` and ``select``: the other options are read at run time);
        ``mode="reduce-overhead"`` (CUDA graphs) is refused when it compiles.
    """

    def __init__(
        self,
        *,
        capacity: int | float | str = "auto",
        sign_pack: bool = False,
        min_numel: int = DEFAULT_MIN_NUMEL,
        select: str = "relu",
        backend: str | None = None,
        window: int | None = 1,
        recompute_squares: bool = True,
        host_spill: bool = True,
    ):
        self.options = _options(capacity, sign_pack, min_numel, select, backend, window, recompute_squares, host_spill)
        self._excluded = _session.excluded_sites()
        super().__init__(*hooks_for(_session, self.options, self._excluded))

    def __enter__(self) -> "compressing":
        # The step begins at its first saved tensor, inside the forward, where the host is
        # usually ahead of the GPU: at the entry, after a step synchronized (a loss printed),
        # its work would keep the GPU waiting. The last step may have learned save sites
        # that compiled graphs now leave out.
        if _session.excluded_sites() is not self._excluded:
            self._excluded = _session.excluded_sites()
            self.pack_hook, self.unpack_hook = hooks_for(_session, self.options, self._excluded)
        # An exception (Ctrl-C) may cut any line below short: the block is then not entered and
        # nothing of it stays on (``with`` calls no __exit__ then). What is pushed is noted in
        # the statement that pushes it, which no line of Python can cut short (a signal may
        # still land as the push returns, as in saved_tensors_hooks's own __enter__).
        entry, entries = _Entry(self), _entries()
        try:
            entry.steering = steer_compiles()
            self.pack_hook.use(self.options)
            entry.pushed = _push_hooks(self.pack_hook, self.unpack_hook) or True
            entries.append(entry)
            return self
        except BaseException:
            if entries and entries[-1] is entry:  # appended, then cut short on the way out
                entries.pop()
            _leave(entry)
            raise

    def __exit__(self, *exc) -> None:
        entries = _entries()
        # This block's innermost entry in this thread (blocks may end out of order); none if
        # it ended already (a disable() that Ctrl-C cut short, called again).
        index = next((i for i in range(len(entries) - 1, -1, -1) if entries[i].block is self), None)
        if index is not None:
            _leave(entries.pop(index))
        _session.poll()


def _leave(entry: _Entry) -> None:
    """Undo what an entry of a block did, as far as it got; point its pack hook at the options
    of the thread's innermost block still in effect that shares it."""
    if entry.pushed:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        entry.pushed = False
    pack_hook = entry.block.pack_hook
    for outer in reversed(_entries()):
        if outer.block.pack_hook is pack_hook:
            pack_hook.use(outer.block.options)
            break
    stop_steering(entry.steering)
    entry.steering = None


_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
"""What ``saved_tensors_hooks.__enter__`` calls (returns None)."""

_checked_options: dict[tuple, Options] = {}
"""Options already checked, by their values and types: a training loop enters a block with
the same options at every step, and checking them took a noticeable part of its entry."""
MAX_CHECKED_OPTIONS = 256
"""Option sets kept checked; forgotten all at once past this (options that change every step)."""


def _options(*values) -> Options:
    key = tuple((type(value), value) for value in values)
    try:
        options = _checked_options.get(key)
    except TypeError:  # an unhashable value: Options says what is wrong with it
        return Options(*values)
    if options is None:
        if len(_checked_options) >= MAX_CHECKED_OPTIONS:
            _checked_options.clear()
        options = _checked_options[key] = Options(*values)
    return options


def enable(
    *,
    capacity: int | float | str = "auto",
    sign_pack: bool = False,
    min_numel: int = DEFAULT_MIN_NUMEL,
    select: str = "relu",
    backend: str | None = None,
    window: int | None = 1,
    recompute_squares: bool = True,
    host_spill: bool = True,
) -> None:
    """Compress saved activations in the calling thread from now on, until ``disable()``.

    Takes the same keyword arguments as ``compressing()``. Calling it again replaces the
    options instead of stacking. A ``compressing()`` block inside takes precedence while it
    runs. Steps are told apart by backward: a step begins at the first tensor saved after a
    backward (one that saved tensors for a double backward, as a gradient penalty's
    ``autograd.grad(..., create_graph=True)`` does, ends no step).

    Raises:
        TypeError, ValueError: as for ``compressing()``.
        RuntimeError: called inside a ``compressing()`` block or inside another
            ``saved_tensors_hooks`` block (autograd removes hook pairs last in, first out, so
            that block's exit would remove BitSparse's hooks instead of its own): call it
            outside.
    """
    hooks = compressing(
        capacity=capacity,
        sign_pack=sign_pack,
        min_numel=min_numel,
        select=select,
        backend=backend,
        window=window,
        recompute_squares=recompute_squares,
        host_spill=host_spill,
    )
    _check_innermost("enable", "before")
    disable()
    _local.enabled = hooks.__enter__()  # one statement: Ctrl-C cannot leave the hooks on unrecorded


def disable() -> None:
    """Undo ``enable()`` in the calling thread; does nothing when not enabled.

    Raises:
        RuntimeError: called inside a ``compressing()`` block, or inside a
            ``saved_tensors_hooks`` block opened after ``enable()``: leave it first.
    """
    hooks = getattr(_local, "enabled", None)
    if hooks is None:
        return
    _check_innermost("disable", "after")
    hooks.__exit__(None, None, None)
    _local.enabled = None


def _check_innermost(caller: str, when: str) -> None:
    """Raise unless the thread's innermost saved-tensor hooks are ``enable()``'s or none."""
    enabled = getattr(_local, "enabled", None)
    if _depth() > (enabled is not None):  # first: a block may push the very hooks enable() did
        raise RuntimeError(f"{caller}() cannot be called inside compressing(); call it {when} the block")
    top = _innermost_hooks()
    if top is None or (enabled is not None and top[0] is enabled.pack_hook):
        return
    raise RuntimeError(
        f"{caller}() was called inside a saved_tensors_hooks block opened outside BitSparse: autograd removes "
        "hook pairs last in, first out, so that block's exit would remove BitSparse's hooks instead of its "
        f"own. Call {caller}() {when} that block, or use `with bitsparse.compressing():` inside it."
    )


def _innermost_hooks():
    """The thread's innermost saved-tensor hook pair, or None (a private PyTorch API)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def is_enabled() -> bool:
    """Whether ``enable()`` is in effect in the calling thread."""
    return getattr(_local, "enabled", None) is not None


def stats() -> Stats:
    """Statistics of the current step (or the last finished one, after backward).

    Synchronizes once with the device, to read the arena's confirmations and counters.
    """
    return _session.stats()


def mark(t: torch.Tensor) -> torch.Tensor:
    """Flag ``t`` as a ReLU-family activation, for tensors a custom autograd Function saves.

    Call it on the tensor before ``ctx.save_for_backward`` (inside ``compressing()`` or
    with ``enable()``), and save what it returns: ``t`` itself in eager mode; in code that
    ``torch.compile`` traces, the output of a ``bitsparse::mark`` op, which carries the mark
    into the graph (inductor compiles it to nothing; other backends copy). Any
    tensor may be marked: the storage is lossless whatever the values are, marking only
    decides what is worth compressing (a marked save site that does not shrink is kept dense).

    Raises:
        TypeError: ``t`` is not a tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mark expects a torch.Tensor, got {type(t).__name__}")
    if torch.compiler.is_compiling():
        return torch.ops.bitsparse.mark(t)
    _session.marks.mark(t)
    return t


def reset() -> None:
    """Forget everything BitSparse holds and learned: the arenas (their memory is released),
    the statistics (steps count from 1 again), which save sites do not pay, the exactness
    checks and the marks. For tests, or to start a different workload afresh.

    Raises:
        RuntimeError: BitSparse's hooks are installed in this thread (leave ``compressing()``,
            call ``disable()``), or compressed tensors are alive (run backward, or drop the
            graphs that hold them).
    """
    if _depth():
        raise RuntimeError("reset() cannot be called while BitSparse is enabled or inside compressing()")
    _session.reset()
