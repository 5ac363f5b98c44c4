"""The ops a compiled graph stores and restores with, and ``bitsparse::mark``.

A compiled forward's pack of a selected tensor is a ``bitsparse::store`` (or, fused with its
square, ``bitsparse::store_relu_square``), and its backward's unpack a
``bitsparse::restore_into`` (or ``bitsparse::restore_relu_square_backward``); see
``hooks.compiled`` for how they get into the graphs and ``hooks.graph_passes`` for the fused
forms. The ops are Python functions registered with the dispatcher, which inductor's
generated Python code calls directly (``_write_direct_call``): ``store`` hands the tensor to
the session, which compresses it into the device's arena exactly as in eager mode, and
returns a *key*, a one-element CPU tensor carrying the handle; ``restore_into`` decodes the
handle the key names into a buffer the backward graph allocated. The graph saves only the
key, so the handle lives exactly as long as the graph's saved tensors do.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

installed_hooks: dict[int, tuple] = {}
"""The session and run-time options of each hook pair, by number (``hooks.compiled``
installs them): the ops take plain values."""

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
    session, options = installed_hooks[hooks]
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
def register_lowerings() -> None:
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
