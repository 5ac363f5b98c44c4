"""The training API: store ReLU-family activations compressed while autograd keeps them.

``compressing()`` wraps a forward pass; ``enable()`` does the same for the calling thread
until ``disable()``. Both install a ``torch.autograd.graph.saved_tensors_hooks`` pair whose
pack hook reads from each saved tensor's ``grad_fn`` whether a ReLU-family op produced it.
Tensors are compressed into one arena per device, restored bit for bit in backward, and the
arena is reused as soon as the step's graph is freed.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from bitsparse.hooks.manager import Options, Session, Stats

_session = Session()
_local = threading.local()


class _Installation:
    """The hooks for one set of options; counts the thread's open installations."""

    def __init__(self, options: Options):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            functools.partial(_session.pack, options), _session.unpack
        )

    def __enter__(self):
        _session.begin_step_if_idle()
        _local.depth = getattr(_local, "depth", 0) + 1
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        _session.poll()
        _local.depth -= 1
        return False


@contextlib.contextmanager
def compressing(**options):
    """Store the activations saved for backward inside this block compressed.

    Saved tensors that ReLU-family ops produced (relu, relu6, threshold/clamp/hardtanh with
    a nonnegative lower bound, in place or not, and squares of these), or that ``mark``
    flagged, are stored as a bitmask and their nonzero values in a per-device arena, and
    restored bit for bit when backward needs them. Everything else is kept as it is.
    Gradients are identical to a run without ``compressing()``.

    Example::

        with bitsparse.compressing():
            loss = model(batch)      # ReLU outputs saved for backward are compressed here
        loss.backward()              # and decoded here; the arena is then free for the next step

    Args:
        **options: see ``bitsparse.Options`` (capacity, sign_pack, min_numel, select,
            backend, window, recompute_squares).

    Raises:
        TypeError: an unknown option. ValueError: an option out of range.

    Notes:
        Hooks are thread-local and the innermost pair wins: inside a non-reentrant
        ``torch.utils.checkpoint`` region, checkpointing's own hooks apply, so only the
        region's inputs reach BitSparse.
    """
    with _Installation(Options.from_kwargs(options)):
        yield


def enable(**options) -> None:
    """Compress saved activations in the calling thread from now on, until ``disable()``.

    Takes the same options as ``compressing()``. Calling it again replaces the options
    instead of stacking. A ``compressing()`` block inside takes precedence while it runs.

    Raises:
        TypeError, ValueError: as for ``compressing()``.
        RuntimeError: called while a ``compressing()`` block is open (close it first).
    """
    installation = _Installation(Options.from_kwargs(options))
    disable()
    if getattr(_local, "depth", 0):
        raise RuntimeError("enable() cannot be called inside compressing(); call it before")
    installation.__enter__()
    _local.enabled = installation


def disable() -> None:
    """Undo ``enable()`` in the calling thread; does nothing when not enabled.

    Raises:
        RuntimeError: called while a ``compressing()`` block is open.
    """
    installation = getattr(_local, "enabled", None)
    if installation is None:
        return
    if _local.depth != 1:
        raise RuntimeError("disable() cannot be called inside compressing(); call it after")
    installation.__exit__(None, None, None)
    _local.enabled = None


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
    with ``enable()``); it returns ``t`` unchanged. Any tensor may be marked: the storage is
    lossless whatever the values are, marking only decides what is worth compressing.

    Raises:
        TypeError: ``t`` is not a tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mark expects a torch.Tensor, got {type(t).__name__}")
    _session.marks.mark(t)
    return t
