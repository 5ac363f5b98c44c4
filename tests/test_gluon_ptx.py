"""The inline PTX of the Gluon kernels, checked on the CPU (the kernels themselves need CUDA:
``tests/test_gpu_codec.py`` runs them against the reference).

Each PTX block is generated for a thread's ``elements`` operands, and names them by
number: a misnumbered operand would read another value's register silently. These tests
check that every block reads exactly the operands its constraint string declares, in the
registers the constraints give them (64-bit ones only where an address is expected).
"""

import re

import pytest

pytest.importorskip("triton.experimental.gluon")

from bitsparse.codecs import gluon_kernels  # noqa: E402

# (operands per thread, values per 16-byte vector, bits): those of 4 warps on a group of
# GROUP tiles (encoder: one operand per 32-bit word of values) or one tile (decoder: one per
# value), for 8-, 16- and 32-bit values.
ENCODER_SHAPES = [
    (gluon_kernels.GROUP * gluon_kernels.TILE * bits // (128 * 32), 128 // bits, bits) for bits in (8, 16, 32)
]
DECODER_SHAPES = [(gluon_kernels.TILE // 128, 128 // bits, bits) for bits in (8, 16, 32)]


def operand_uses(ptx: str) -> dict[int, set[str]]:
    """For each operand number, the mnemonics of the PTX instructions that use it."""
    uses: dict[int, set[str]] = {}
    for line in ptx.splitlines():
        instruction = re.match(r"\s*(?:@!?\w+\s+)?([a-z][\w.]*)", line)
        for number in re.findall(r"\$(\d+)", line):
            uses.setdefault(int(number), set()).add(instruction.group(1))
    return uses


def check_operands(ptx: str, constraints: str, elements: int, per_value: set[int], unused: set[int] = frozenset()):
    """The operands of ``ptx`` against its ``constraints``, in groups of ``elements``.

    Groups in ``per_value`` hold one operand per value: all are read. Groups in ``unused``
    are not read. The others repeat one per-vector or per-program operand: some are read.
    64-bit operands are read only as addresses, 32-bit ones never.
    """
    kinds = constraints.split(",")
    assert len(kinds) % elements == 0
    uses = operand_uses(ptx)
    assert max(uses) < len(kinds), "an operand beyond the constraints"
    addressing = {"add.u64", "mad.wide.u32"}
    for group in range(len(kinds) // elements):
        numbers = range(group * elements, (group + 1) * elements)
        used = [n for n in numbers if n in uses]
        if group in per_value:
            assert used == list(numbers), f"group {group}: not every value's operand is read"
        elif group in unused:
            assert not used, f"group {group} is read"
        else:
            assert used, f"group {group} is not read"
        for n in used:
            if kinds[n] == "l":
                assert uses[n] <= addressing, f"${n} is 64-bit but read by {uses[n]}"
            else:
                assert not uses[n] & addressing, f"${n} is 32-bit but read as an address"


@pytest.mark.parametrize("elements, vector, bits", ENCODER_SHAPES, ids=str)
def test_encoder_compaction_operands(elements, vector, bits):
    ptx = gluon_kernels._compaction_ptx.fn(elements, vector, 128, 2 * 4096 * bits // 8, bits)
    constraints = gluon_kernels._compaction_constraints.fn(elements)
    # Outputs (unused), values, vector masks, vector bytes, last words, lead, stop, address.
    check_operands(ptx, constraints, elements, per_value={1}, unused={0} | ({4} if bits == 32 else set()))


@pytest.mark.parametrize("elements, vector, bits", ENCODER_SHAPES, ids=str)
def test_encoder_packing_operands(elements, vector, bits):
    region = gluon_kernels._packing_region_bytes.fn(4096, bits // 8)
    ptx = gluon_kernels._packing_ptx.fn(elements, vector, 128, region, bits)
    constraints = gluon_kernels._packing_constraints.fn(elements)
    # Outputs (unused), values, vector masks, vector bytes, the two tails, split, total, flags,
    # address.
    check_operands(ptx, constraints, elements, per_value={1}, unused={0})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_encoder_square_operands(dtype):
    from triton.experimental.gluon import language as gl

    bits = 32 if dtype == "float32" else 16
    elements = next(shape[0] for shape in ENCODER_SHAPES if shape[2] == bits)
    ptx = gluon_kernels._square_ptx.fn(elements, getattr(gl, dtype), 128)
    constraints = gluon_kernels._square_constraints.fn(elements)
    # Outputs (unused), values, the square's bytes from the group's first, its address.
    check_operands(ptx, constraints, elements, per_value={1}, unused={0})


@pytest.mark.parametrize("may_be_packed", [False, True], ids=["raw", "packed"])
@pytest.mark.parametrize("elements, vector, bits", DECODER_SHAPES, ids=str)
def test_decoder_operands(elements, vector, bits, may_be_packed):
    ptx = gluon_kernels._restore_ptx.fn(elements, vector, 128, 4096 * bits // 8, bits, may_be_packed)
    constraints = gluon_kernels._restore_constraints.fn(elements)
    # Outputs, vector masks, vector ranks, lead, stop, address, packed flag.
    check_operands(ptx, constraints, elements, per_value={0}, unused=set() if may_be_packed else {6})
    # Every value's output is defined on every path (zero where its mask bit is clear).
    for path in ptx.split("bs_packed:"):
        assert {int(n) for n in re.findall(r"mov\.u32 \$(\d+), 0;", path)} >= set(range(elements))
