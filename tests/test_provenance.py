"""Detection from the autograd graph: which saved tensors count as ReLU-family, which are hidden
behind CopySlices, which are not; and the save sites learned from hidden tensors that do not pay.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_hooks import (  # noqa: F401 (clean_session: autouse fixture)
    OPTIONS,
    alive,
    assert_same_grads,
    clean_session,
    expected_nbytes,
    seeded,
    train_step,
)

import bitsparse
from bitsparse.hooks.provenance import Provenance, classify_node, squared_operand

RELU, HIDDEN = Provenance.RELU, Provenance.HIDDEN


def _times_itself(h):
    return h * h


def _on_view(op):
    """``op`` applied in place to a view of a Linear's output, as in ``fc(x).relu_()``."""
    fc = nn.Linear(4, 8)
    return lambda x: op(fc(x.view(2, 3, 4)))


CASES = {
    "relu": (F.relu, RELU),
    "relu_": (lambda x: x.clone().relu_(), RELU),
    "nn.ReLU(inplace)": (lambda x: nn.ReLU(inplace=True)(x * 1), RELU),
    "relu6": (F.relu6, RELU),
    "hardtanh(0, 2)": (lambda x: F.hardtanh(x, 0.0, 2.0), RELU),
    "hardtanh(-1, 1)": (F.hardtanh, None),
    "clamp(min=0)": (lambda x: x.clamp(min=0), RELU),
    "clip(0, 1)": (lambda x: x.clip(0, 1), RELU),
    "clamp_min(0.5)": (lambda x: x.clamp_min(0.5), RELU),
    "clamp(min=-1)": (lambda x: x.clamp(min=-1), None),
    "clamp(max=1)": (lambda x: x.clamp(max=1), None),
    "clamp(min=tensor)": (lambda x: x.clamp(min=torch.zeros(())), None),
    "relu().clamp(max=1)": (lambda x: F.relu(x).clamp(max=1), RELU),
    "relu().clamp_max(0)": (lambda x: F.relu(x).clamp_max(0), RELU),
    "relu().clamp_max(-1)": (lambda x: F.relu(x).clamp_max(-1), None),
    "threshold": (lambda x: F.threshold(x, 0.0, 0.0), HIDDEN),  # its node drops the value
    "relu().square()": (lambda x: F.relu(x).square(), RELU),
    "relu() ** 2": (lambda x: F.relu(x) ** 2, RELU),
    "relu() ** 3": (lambda x: F.relu(x) ** 3, None),
    "relu() * relu()": (lambda x: _times_itself(F.relu(x)), RELU),
    "relu(x) * relu(y)": (lambda x: F.relu(x) * F.relu(x * 2), RELU),
    # A product is zero where a ReLU-family factor is; autograd does not show the sign of a
    # factor without gradient (a scalar, a mask, dropout's noise on the CPU).
    "relu() * x": (lambda x: F.relu(x) * x, HIDDEN),
    "x * relu()": (lambda x: x * F.relu(x), HIDDEN),
    "relu() * 2": (lambda x: F.relu(x) * 2, HIDDEN),
    "(relu() * x).t()": (lambda x: (F.relu(x) * x).t(), HIDDEN),
    "(relu() * relu()) * x": (lambda x: _times_itself(F.relu(x)) * x, HIDDEN),
    "tanh() * x": (lambda x: torch.tanh(x) * x, None),
    "dropout(relu()), CPU": (lambda x: F.dropout(F.relu(x), 0.25), HIDDEN),
    "native_dropout(relu())": (lambda x: torch.native_dropout(F.relu(x), 0.25, True)[0], RELU),
    "native_dropout(x)": (lambda x: torch.native_dropout(x, 0.25, True)[0], None),
    "relu().t()": (lambda x: F.relu(x).t(), RELU),
    "relu()[1:]": (lambda x: F.relu(x)[1:], RELU),
    "relu().view(-1)": (lambda x: F.relu(x).view(-1), RELU),
    "relu().to(bf16)": (lambda x: F.relu(x).to(torch.bfloat16), RELU),
    "relu_ on a view": (_on_view(lambda y: y.relu_()), HIDDEN),
    "relu_ on a view, squared, viewed": (_on_view(lambda y: (y.relu_() ** 2).view(6, 8)), HIDDEN),
    "sigmoid_ on a view": (_on_view(lambda y: y.sigmoid_()), HIDDEN),
    "exp": (torch.exp, None),
    "leaky_relu": (F.leaky_relu, None),
    "relu() + 1": (lambda x: F.relu(x) + 1, None),
    "leaf": (lambda x: x, None),
}


@pytest.mark.parametrize("name", CASES)
def test_classification(name):
    op, expected = CASES[name]
    x = torch.randn(6, 4, requires_grad=True)
    y = op(x)
    assert classify_node(y.grad_fn) == expected


def test_classification_never_reads_saved_tensors():
    """Reading a node's saved tensor would run the unpack hook (and decode)."""
    unpacked = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: ("packed", t), lambda p: unpacked.append(p) or p[1]):
        y = F.relu(torch.randn(5, requires_grad=True)).square().view(5, 1)
    assert classify_node(y.grad_fn) == RELU
    assert squared_operand(y.grad_fn.next_functions[0][0]) is not None
    assert unpacked == []


@pytest.mark.parametrize(
    "spelling, exponent", [("square", 2), ("pow", 2.0), ("mul", None)], ids=["square", "pow", "mul"]
)
def test_squared_operand_is_what_the_pack_hook_returned(spelling, exponent):
    """A square's node gives what the pack hook returned for the tensor it squared (each
    pack returns a new object here: ``x * x`` saves its operand twice), and how it squared."""
    square = {"square": torch.square, "pow": lambda r: r.pow(2.0), "mul": lambda r: r * r}[spelling]
    packed = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.setdefault(id(t), [t]), lambda p: p[0]):
        r = F.relu(torch.randn(5, requires_grad=True))
        s = square(r)
    operand, how = squared_operand(s.grad_fn)
    assert operand is packed[id(r)] and how.exponent == exponent
    assert torch.equal(how(r), s)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: [t], lambda p: p[0]):
        twice = r * r  # two packs, two objects: not the same saved value
    assert squared_operand(twice.grad_fn) is None
    plain = square(r)
    assert squared_operand(plain.grad_fn)[0] is r  # saved without hooks: the tensor itself
    assert squared_operand(torch.exp(r).grad_fn) is None


class HiddenOnView(nn.Module):
    """``fc(x).<op>_()`` on the 3-D output of a Linear with bias: CopySlices hides the op."""

    def __init__(self, op: str):
        super().__init__()
        torch.manual_seed(0)
        self.op = op
        self.fc, self.out = nn.Linear(32, 256), nn.Linear(256, 8)

    def forward(self, x):
        h = getattr(self.fc(x), self.op)()
        return self.out(h)


def stats_per_step(model: nn.Module, steps: int, **options) -> list:
    """Train ``steps`` steps under ``compressing(**OPTIONS, **options)``, checking
    each step's gradients against a plain step; the stats of every step."""
    x = torch.randn(4, 16, 32, requires_grad=True)
    expected = train_step(model, x, contextlib.nullcontext())
    stats = []
    for _ in range(steps):
        got = train_step(model, x, bitsparse.compressing(**{**OPTIONS, **options}))
        assert_same_grads(got, expected)
        stats.append(bitsparse.stats())
    return stats


def test_a_hidden_relu_is_compressed_every_step():
    for s in stats_per_step(HiddenOnView("relu_"), 3):
        assert s.tensors_compressed == 1 and "unprofitable_site" not in s.tensors_skipped


def test_a_hidden_site_that_does_not_pay_is_tried_once():
    steps = stats_per_step(HiddenOnView("sigmoid_"), 3)
    assert [s.tensors_compressed for s in steps] == [1, 0, 0]
    # Both saves of the tensor (sigmoid_'s result and the Linear's input view) share a site.
    assert steps[-1].tensors_skipped["unprofitable_site"] == 2


class MarkedHiddenOnView(HiddenOnView):
    """The author marks the hidden tensor before the Linear saves it."""

    def forward(self, x):
        return self.out(bitsparse.mark(getattr(self.fc(x), self.op)()))


def test_a_marked_tensor_whose_site_does_not_pay_is_kept_dense():
    steps = stats_per_step(MarkedHiddenOnView("sigmoid_"), 3)
    # A mark says what to try; a site that does not shrink is kept dense from then on,
    # marked or not: storing it would cost more than it saves.
    assert [s.tensors_compressed for s in steps] == [1, 0, 0]
    assert steps[-1].tensors_skipped["unprofitable_site"] == 2


def test_a_relu_family_site_without_zeros_is_kept_dense():
    """``clamp(min=0.5)`` is ReLU-family (never negative) but has no zeros: stored, it would
    be larger than dense every step."""
    torch.manual_seed(0)
    fc, out = nn.Linear(32, 256), nn.Linear(256, 8)
    model = nn.Sequential(fc, nn.Hardtanh(0.5, 1e9), out)
    x = torch.randn(64, 32, requires_grad=True)
    expected = train_step(model, x, contextlib.nullcontext())
    steps = []
    for options in ({}, {"capacity": "auto"}):  # an explicit arena, then one that follows demand
        bitsparse.reset()
        for _ in range(3):
            assert_same_grads(train_step(model, x, bitsparse.compressing(**{**OPTIONS, **options})), expected)
            steps.append(bitsparse.stats())
    # Stored (explicit arena) or measured (the first step of an "auto" one), then kept dense;
    # the arena that had no other use is released.
    assert [s.tensors_compressed for s in steps] == [1, 0, 0, 0, 0, 0]
    assert steps[3].fallbacks == {"arena_full": 1}
    for s in steps[1:3] + steps[4:]:
        assert s.tensors_skipped.get("unprofitable_site") == 1 and s.arena_reserved < 1024


def test_an_overflow_does_not_teach_that_a_site_does_not_pay():
    # The arena starts too small for the values; it grows after the first step.
    steps = stats_per_step(HiddenOnView("relu_"), 2, capacity=16 << 10)
    assert steps[0].fallbacks == {"arena_full": 1}
    assert steps[1].fallbacks == {} and steps[1].tensors_compressed == 1
    assert "unprofitable_site" not in steps[1].tensors_skipped


class ReluThen(nn.Module):
    """``out(<after>(relu(fc(x))))`` where ``after`` is zero where the ReLU is: dropout, as on
    the CPU (a product with noise) and as on CUDA (``native_dropout``), or a ReGLU's gate, or
    a ReLU²-GLU's (the ReLU's square times ``up(x)``)."""

    def __init__(self, after: str):
        super().__init__()
        torch.manual_seed(0)
        self.after = after
        self.fc, self.up, self.out = nn.Linear(32, 256), nn.Linear(32, 256), nn.Linear(256, 8)
        with torch.no_grad():
            self.fc.bias.fill_(-0.4)  # about 80% zeros: a ReGLU's product is -0.0 where up(x) < 0

    def forward(self, x):
        h = F.relu(self.fc(x))
        if self.after == "dropout":
            return self.out(F.dropout(h, 0.25))
        if self.after == "native_dropout":
            return self.out(torch.native_dropout(h, 0.25, True)[0])
        if self.after == "relu2_glu":
            h = h**2
        return self.out(h * self.up(x))  # reglu


@pytest.mark.parametrize(
    "after, recompute",
    [("dropout", True), ("native_dropout", True), ("reglu", True), ("reglu", False), ("relu2_glu", True)],
)
def test_products_that_keep_a_relus_zeros_are_stored_or_recomputed(after, recompute):
    """What the second Linear saves is dropout's output (T5's and VGG's MLPs), stored beside
    the ReLU output, or a ReGLU's product (ProSparse's ReLU LLaMA), recomputed from the ReLU
    output and ``up(x)``, which its node saved (stored, with ``recompute_squares=False``), or
    a ReLU²-GLU's, recomputed from the square, itself recomputed from the ReLU output:
    gradients bit for bit either way."""
    model = ReluThen(after)
    x = torch.randn(4, 16, 32, requires_grad=True)
    expected = train_step(model, x, seeded(contextlib.nullcontext()))
    torch.manual_seed(1)
    relu = F.relu(model.fc(x))
    if after == "dropout":
        product = F.dropout(relu, 0.25)
    elif after == "native_dropout":
        product = torch.native_dropout(relu, 0.25, True)[0]
    else:
        product = (relu if after == "reglu" else relu**2) * model.up(x)
    recomputed = {"reglu": 1, "relu2_glu": 2}.get(after, 0) if recompute else 0
    compressed = 1 if recomputed else 2
    nbytes = expected_nbytes(relu)[0] + (0 if recomputed else expected_nbytes(product)[0])
    assert (product == 0).float().mean() >= (relu == 0).float().mean() > 0.7  # as sparse as the ReLU's
    options = {**OPTIONS, "recompute_squares": recompute}
    for _ in range(3):
        assert_same_grads(train_step(model, x, seeded(bitsparse.compressing(**options))), expected)
        s = bitsparse.stats()
        assert (s.tensors_compressed, s.tensors_recomputed, s.fallbacks) == (compressed, recomputed, {})
        assert s.stored_bytes == nbytes
    assert alive() == 0


def test_a_product_whose_factor_changed_in_place_is_not_recomputed_from_it():
    """``up(x)`` changed in place after the product: the product's first unpack (the second
    Linear's, whose weight gradient it gives) raises autograd's error, rather than recompute
    the product from the new values (without BitSparse, the product's own node raises)."""
    model = ReluThen("reglu")
    x = torch.randn(4, 16, 32)
    with bitsparse.compressing(**OPTIONS):
        up = model.up(x)
        y = model.out(F.relu(model.fc(x)) * up)
        up.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    assert model.out.weight.grad is None and bitsparse.stats().tensors_recomputed == 1
    del y
    assert alive() == 0


def test_squares_written_as_products_are_recomputed():
    torch.manual_seed(0)
    fc, out = nn.Linear(32, 256), nn.Linear(256, 8)
    x = torch.randn(64, 32, requires_grad=True)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = fc, out

        def forward(self, x):
            h = F.relu(self.fc(x))
            return self.out(h * h)

    model = Model()
    expected = train_step(model, x, contextlib.nullcontext())
    got = train_step(model, x, bitsparse.compressing(**OPTIONS))
    assert_same_grads(got, expected)
    s = bitsparse.stats()
    assert (s.tensors_compressed, s.tensors_recomputed) == (1, 1)


def test_the_square_of_another_tensor_is_not_recomputed_from_a_stored_one():
    """``relu(a) * relu(a)`` once, then ``relu(b) ** 2``: each square finds its own source."""
    torch.manual_seed(0)
    a = torch.randn(64, 256, requires_grad=True)
    b = torch.randn(64, 256, requires_grad=True)

    def run(ctx):
        for t in (a, b):
            t.grad = None
        with ctx:
            ha, hb = F.relu(a), F.relu(b)
            loss = (ha.square() * 3).sum() + (hb**2).sum() + (ha.square() @ hb.t()).sum()
        loss.backward()
        return [a.grad.clone(), b.grad.clone()]

    expected = run(contextlib.nullcontext())
    assert_same_grads(run(bitsparse.compressing(**OPTIONS)), expected)
    assert alive() == 0
