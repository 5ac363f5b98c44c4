"""The torch (reference) backend on the CPU: exact round trips, sizes and the stored layout.

Every round trip is also checked against the NumPy reference encoding in ``helpers.py``
(masks, packed flags, nnz, nbytes via ``format.compressed_nbytes`` and the value-stream
words of every tile).
"""

import math

import numpy as np
import pytest
import torch
from helpers import (
    DTYPES,
    SPECIALS,
    assert_bitwise_equal,
    below_zero_cleared,
    check_against_reference,
    check_successive_appends,
    compress_relu_of,
    compress_with,
    decode_relu_square_backward,
    dtype_id,
    from_patterns,
    generator,
    int_view,
    make_input,
    random_bits,
    special_patterns,
    to_unsigned_numpy,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitsparse import CompressedTensor, TileGeometry, ValueBuffer, compress, decompress
from bitsparse.codecs import SQUARE_DTYPES, get_codec
from bitsparse.compressed import decompress_with
from bitsparse.format import PACKED_TILE_FLAG, compressed_nbytes, dtype_spec

BACKEND = "torch"
ZERO_FRACTIONS = [0.0, 0.06, 0.5, 0.9, 0.999, 1.0]
SIZES = [0, 1, 4095, 4096, 4097, 3 * 4096 + 17]  # 10**6: test_roundtrip_one_million
BIG = 10**6


def roundtrip(x, sign_pack, geometry=TileGeometry(), backend=BACKEND):
    c = compress(x, sign_pack=sign_pack, backend=backend, geometry=geometry)
    assert isinstance(c, CompressedTensor)
    check_against_reference(c, x, sign_pack, geometry)
    y = decompress(c, backend=backend)
    assert y.is_contiguous()
    assert not y.requires_grad
    assert_bitwise_equal(y, x)
    return c, y


# --------------------------------------------------------------------------------------------
# The helpers themselves (a wrong special or input generator would weaken every test below)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_specials_are_what_their_names_say(dtype):
    spec = dtype_spec(dtype)
    for name, pattern in SPECIALS[dtype].items():
        v = from_patterns([pattern], dtype).float()[0]
        assert (name.startswith("-")) == bool(pattern >> (spec.bits - 1)), name
        if "nan" in name:
            assert torch.isnan(v), name
        elif "inf" in name:
            assert torch.isinf(v) and (v > 0) == name.startswith("+"), name
        elif name == "-zero":
            assert v == 0 and torch.signbit(v)
        elif "max_finite" in name:
            assert abs(v) == torch.finfo(dtype).max, name
        elif "min_normal" in name:
            assert v == torch.finfo(dtype).smallest_normal, name
        elif "subnormal" in name:
            assert 0 < abs(v) < torch.finfo(dtype).smallest_normal, name
        else:
            assert v == -1.5, name
    if dtype == torch.float8_e4m3fn:
        assert not any("inf" in n for n in SPECIALS[dtype])


def test_assert_bitwise_equal_distinguishes_zero_signs_and_nan_payloads():
    pz, nz = torch.tensor([0.0]), torch.tensor([-0.0])
    assert torch.equal(pz, nz)  # numerically equal ...
    with pytest.raises(AssertionError):
        assert_bitwise_equal(pz, nz)  # ... but not bitwise
    nan1 = from_patterns([0x7FC0], torch.bfloat16)
    nan2 = from_patterns([0x7FC1], torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_bitwise_equal(nan1, nan2)
    assert_bitwise_equal(nan1, nan1.clone())
    with pytest.raises(AssertionError):
        assert_bitwise_equal(pz, pz.view(1, 1))
    with pytest.raises(AssertionError):
        assert_bitwise_equal(pz, pz.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("numel", [1, 10, 4097, 100_000])
@pytest.mark.parametrize("zero_fraction", [0.0, 0.3, 1.0])
def test_make_input(dtype, numel, zero_fraction):
    for specials in (False, True):
        x = make_input(numel, dtype, zero_fraction, generator(numel), specials=specials)
        u = to_unsigned_numpy(x)
        assert x.dtype == dtype and x.shape == (numel,)
        assert (u == 0).sum() == round(zero_fraction * numel)
        sign = u >> (dtype_spec(dtype).bits - 1)
        if not specials:
            assert not sign.any()
        elif zero_fraction < 1 and numel >= 100:
            present = set(u.tolist())
            assert set(special_patterns(dtype)) <= present


def test_reference_check_catches_corruption():
    """The checks used throughout notice a single flipped bit in any part of the encoding."""
    x = make_input(3 * 4096 + 17, torch.bfloat16, 0.5, generator("corrupt"), specials=False)
    c = compress(x, sign_pack=True, backend=BACKEND)
    check_against_reference(c, x, True)
    for part, index, bit, message in [
        (c.values.words, (5,), 7, "value stream"),
        (c.masks, (1, 3), 0, "masks"),
        (c.tile_words, (2,), 31, "packed flags"),
        (c.tile_words, (2,), 0, "overlap or leave gaps"),
    ]:
        part[index] ^= 1 << bit if bit < 31 else -(1 << 31)
        with pytest.raises(AssertionError, match=message):
            check_against_reference(c, x, True)
        with pytest.raises(AssertionError):
            assert_bitwise_equal(decompress(c, backend=BACKEND), x)
        part[index] ^= 1 << bit if bit < 31 else -(1 << 31)
        check_against_reference(c, x, True)


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("numel", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("zero_fraction", ZERO_FRACTIONS, ids=lambda z: f"z{z}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_roundtrip_with_specials(dtype, zero_fraction, numel, sign_pack):
    x = make_input(numel, dtype, zero_fraction, generator(dtype, zero_fraction, numel))
    c, _ = roundtrip(x, sign_pack)
    if not sign_pack:
        assert not (c.tile_words < 0).any()


@pytest.mark.parametrize("numel", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("zero_fraction", ZERO_FRACTIONS, ids=lambda z: f"z{z}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_roundtrip_signpack_without_specials(dtype, zero_fraction, numel):
    """No value has its sign bit set, so every tile must take the packed path."""
    x = make_input(numel, dtype, zero_fraction, generator(dtype, zero_fraction, numel), specials=False)
    c, _ = roundtrip(x, sign_pack=True)
    assert c.num_tiles == math.ceil(numel / 4096)
    assert (c.tile_words < 0).all()
    spec = dtype_spec(dtype)
    counts = [int(t.sum()) for t in torch.from_numpy(to_unsigned_numpy(x) != 0).split(4096)]
    assert c.nnz() == sum(counts) == numel - round(zero_fraction * numel)
    raw = compressed_nbytes(numel, spec, counts, [False] * len(counts))
    assert c.nbytes == compressed_nbytes(numel, spec, counts, [True] * len(counts)) <= raw
    if max(counts, default=0) >= 32:
        assert c.nbytes < raw  # packing really saved space


# 10**6 elements take about 0.6 s a case on two cores, so only a subset of the matrix runs.
ONE_MILLION_CASES = [
    (dtype, zero_fraction, sign_pack, specials)
    for dtype in DTYPES
    for zero_fraction, sign_pack, specials in [(0.06, False, True), (0.5, True, True), (0.9, True, False)]
] + [
    (torch.bfloat16, 0.0, True, True),
    (torch.bfloat16, 0.999, True, True),
    (torch.float8_e5m2, 1.0, True, True),
]


@pytest.mark.parametrize(
    "dtype, zero_fraction, sign_pack, specials",
    ONE_MILLION_CASES,
    ids=[
        f"{dtype_id(d)}-z{z}-{'signpack' if p else 'raw'}-{'specials' if s else 'plain'}"
        for d, z, p, s in ONE_MILLION_CASES
    ],
)
def test_roundtrip_one_million(dtype, zero_fraction, sign_pack, specials):
    x = make_input(BIG, dtype, zero_fraction, generator(dtype, zero_fraction, BIG), specials=specials)
    c, _ = roundtrip(x, sign_pack)
    packed = c.tile_words < 0
    if sign_pack and zero_fraction < 1:
        # Specials put sign bits in a few tiles only: both encodings occur in one tensor.
        assert packed.any()
        assert bool(packed.all()) == (not specials)


def test_packed_flag_per_tile():
    """A tile holding -0.0 or a negative value is raw; the other tiles are packed."""
    x = make_input(5 * 4096, torch.bfloat16, 0.5, generator("flags"), specials=False)
    bits = x.view(torch.int16)
    bits[4096 + 100] = -0x8000  # -0.0 in tile 1
    bits[3 * 4096 + 4095] = from_patterns([0xBF80], torch.bfloat16).view(torch.int16)[0]  # -1.0, tile 3
    bits[4 * 4096 + 7] = 0  # a zero does not matter
    c, _ = roundtrip(x, sign_pack=True)
    assert (c.tile_words < 0).tolist() == [True, False, True, False, True]
    c, _ = roundtrip(x, sign_pack=False)
    assert (c.tile_words < 0).tolist() == [False] * 5


def test_all_zero_tile_with_sign_pack_is_packed_and_empty():
    x = torch.zeros(2 * 4096, dtype=torch.float16)
    x[5000] = -2.0
    c, _ = roundtrip(x, sign_pack=True)
    assert (c.tile_words < 0).tolist() == [True, False]
    assert c.nnz() == 1
    assert c.nbytes == 2 * 516 + 4


# --------------------------------------------------------------------------------------------
# Shapes, layouts, autograd


SHAPES = [(), (1,), (7, 13), (2, 3, 4097), (64, 64, 3), (3, 4096), (1, 1, 1, 5000), (0,), (0, 5), (5, 0, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_shapes(shape, dtype, sign_pack):
    numel = math.prod(shape)
    x = make_input(numel, dtype, 0.5, generator(shape, dtype)).reshape(shape)
    c, y = roundtrip(x, sign_pack)
    assert c.shape == x.shape and y.shape == x.shape and c.numel == numel
    assert c.dtype == dtype and y.dtype == dtype
    assert c.device == y.device == torch.device("cpu")
    assert c.dense_nbytes == numel * x.element_size()


def test_scalar():
    for value in (0.0, -0.0, 3.5, float("nan"), float("-inf")):
        x = torch.tensor(value, dtype=torch.float32)
        for sign_pack in (False, True):
            c, y = roundtrip(x, sign_pack)
            assert y.dim() == 0
            assert c.nnz() == (0 if int_view(x).item() == 0 else 1)


@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0, 3)], ids=str)
@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_empty_tensor(shape, sign_pack):
    x = torch.empty(shape, dtype=torch.float16)
    c = compress(x, sign_pack=sign_pack, backend=BACKEND)
    assert c.num_tiles == 0 and c.masks.shape == (0, 128) and c.tile_words.shape == (0,)
    assert c.nnz() == 0 and c.nbytes == 0 and c.dense_nbytes == 0 and c.fits()
    assert int(c.stream_words()) == 0 and int(c.values.cursor) == 0
    assert_bitwise_equal(decompress(c, backend=BACKEND), x)


def _non_contiguous_cases():
    g = generator("noncontig")
    base = make_input(6 * 4096 + 40, torch.bfloat16, 0.6, g)
    m = base[: 96 * 256].view(96, 256)
    cube = base[: 16 * 24 * 32].view(16, 24, 32)
    scalar = base[7:8].view(())
    return {
        "transposed": m.t(),
        "step_slice_1d": base[3::3],
        "step_slice_2d": m[::2, 1::3],
        "column": m[:, 5],
        "permuted_3d": cube.permute(2, 0, 1),
        "narrow_last": cube[..., 3:20],
        "expanded_row": m[4].expand(40, 256),
        "expanded_scalar": scalar.expand(5000),
        "broadcast_unsqueeze": base[:300].unsqueeze(0).expand(3, 7, 300),
        "negative_zero_strided": torch.full((4000,), -0.0, dtype=torch.bfloat16)[::2],
    }


NON_CONTIGUOUS = _non_contiguous_cases()


@pytest.mark.parametrize("case", list(NON_CONTIGUOUS))
@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_non_contiguous_inputs(case, sign_pack):
    x = NON_CONTIGUOUS[case]
    assert not x.is_contiguous()
    before = int_view(x).clone()
    c, y = roundtrip(x, sign_pack)
    assert_bitwise_equal(y, x.contiguous())
    assert torch.equal(int_view(x), before)  # the input is not modified


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_non_contiguous_all_dtypes(dtype):
    x = make_input(4096 * 3, dtype, 0.5, generator("nc", dtype)).view(64, 192)
    roundtrip(x.t(), sign_pack=True)
    roundtrip(x[::3, ::2], sign_pack=False)


def test_requires_grad():
    leaf = make_input(9000, torch.float32, 0.5, generator("grad"), specials=False)
    leaf = leaf.view(90, 100).requires_grad_()
    for x in (leaf, leaf * 1, leaf.t()):
        c = compress(x, sign_pack=True, backend=BACKEND)
        y = decompress(c, backend=BACKEND)
        assert not y.requires_grad and y.grad_fn is None
        assert_bitwise_equal(y, x.detach())
        check_against_reference(c, x, True)
    assert leaf.grad is None


# --------------------------------------------------------------------------------------------
# Determinism and the default backend


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_deterministic(sign_pack):
    x = make_input(7 * 4096 + 5, torch.bfloat16, 0.7, generator("det"))
    a = compress(x, sign_pack=sign_pack, backend=BACKEND)
    b = compress(x, sign_pack=sign_pack, backend=BACKEND)
    assert torch.equal(a.masks, b.masks)
    assert torch.equal(a.tile_words, b.tile_words)
    assert int(a.base) == int(b.base) == 0
    n = int(a.stream_words())
    assert n == int(b.stream_words()) > 0
    assert torch.equal(a.values.words[:n], b.values.words[:n])
    # The torch encoder writes tiles in order: offsets are the exclusive prefix sum.
    counts = torch.tensor(to_unsigned_numpy(x) != 0).split(4096)
    widths = torch.where(a.tile_words < 0, 15, 16)
    lengths = torch.tensor([int(k.sum()) for k in counts]) * widths
    lengths = (lengths + 31) // 32
    assert torch.equal((a.tile_words & 0x7FFFFFFF).long(), lengths.cumsum(0) - lengths)


def test_default_backend_on_cpu_is_torch():
    x = make_input(3 * 4096 + 17, torch.float16, 0.5, generator("default"))
    a = compress(x, sign_pack=True)
    b = compress(x, sign_pack=True, backend="torch")
    assert torch.equal(a.masks, b.masks) and torch.equal(a.tile_words, b.tile_words)
    n = int(a.stream_words())
    assert torch.equal(a.values.words[:n], b.values.words[:n])
    assert_bitwise_equal(decompress(a), x)


def test_default_buffer_has_worst_case_capacity():
    x = make_input(3 * 4096 + 17, torch.float32, 0.5, generator("cap"))
    c = compress(x, backend=BACKEND)
    assert c.values.capacity == c.geometry.max_stream_words(x.numel(), 32) == 3 * 4096 + 17
    assert c.values.words.numel() == c.values.capacity + 1
    assert c.fits()


# --------------------------------------------------------------------------------------------
# Hand-made layouts


def test_mask_bits_and_raw_stream_layout_bf16():
    positions = [0, 1, 5, 31, 32, 63, 64, 69]
    values = [1.0, -2.0, 0.5, -0.0, 3.0, 1e-3, 65504.0, float("inf")]
    x = torch.zeros(4096 + 70, dtype=torch.bfloat16)
    x[positions] = torch.tensor(values, dtype=torch.bfloat16)
    x[4096 + 33] = 7.0  # one value in the second tile
    c = compress(x, backend=BACKEND)
    masks = c.masks.view(-1, 128).long() & 0xFFFFFFFF
    assert masks[0, 0] == (1 << 0) | (1 << 1) | (1 << 5) | (1 << 31) == 0x80000023
    assert masks[0, 1] == (1 << 0) | (1 << 31) == 0x80000001
    assert masks[0, 2] == (1 << 0) | (1 << 5) == 0x21
    assert (masks[0, 3:] == 0).all()
    assert masks[1, 1] == 1 << 1 and (masks[1, :1] == 0).all() and (masks[1, 2:] == 0).all()
    assert c.masks.dtype == torch.int32 and c.masks[0, 0] < 0  # bit 31 shows as the int32 sign

    offsets = (c.tile_words & 0x7FFFFFFF).tolist()
    assert offsets == [0, 4] and not (c.tile_words < 0).any()
    stream = c.values.words[int(c.base) :]
    # Tile 0: 8 values in position order, as little-endian int16 pairs in 4 words.
    halves = stream[offsets[0] : offsets[0] + 4].view(torch.int16)
    assert torch.equal(halves, x[positions].view(torch.int16))
    pattern = x[positions].view(torch.int16).long() & 0xFFFF
    for w in range(4):
        assert int(stream[w]) & 0xFFFFFFFF == int(pattern[2 * w]) | int(pattern[2 * w + 1]) << 16
    # Tile 1: one value in the low half of its word; the high half is zero padding.
    assert int(stream[4]) & 0xFFFFFFFF == int(x[4096 + 33].view(torch.int16)) & 0xFFFF
    assert c.nbytes == 2 * 516 + 4 * 5
    assert_bitwise_equal(decompress(c), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_stream_bit_layout(dtype, sign_pack):
    """Value k of a tile at bits [k*b, (k+1)*b) of the tile's words, LSB first (Python ints)."""
    spec = dtype_spec(dtype)
    positive = special_patterns(dtype, sign=False) + [1, 2, 3, (1 << (spec.bits - 1)) - 1]
    patterns = (positive * 6)[:37]  # 37 values: the packed fields straddle word boundaries
    positions = [3 * k + (k % 2) for k in range(37)]
    flat = [0] * 200
    for p, v in zip(positions, patterns):
        flat[p] = v
    x = from_patterns(flat, dtype)
    c = compress(x, sign_pack=sign_pack, backend=BACKEND)
    width = spec.packed_bits if sign_pack else spec.bits
    assert bool(c.tile_words[0] < 0) == sign_pack
    acc = 0
    for k, v in enumerate(patterns):
        acc |= v << (k * width)
    n = math.ceil(37 * width / 32)
    expected = [(acc >> (32 * w)) & 0xFFFFFFFF for w in range(n)]
    got = [int(w) & 0xFFFFFFFF for w in c.values.words[:n]]
    assert got == expected
    assert int(c.stream_words()) == n
    assert c.nbytes == 516 + 4 * n
    assert_bitwise_equal(decompress(c, backend=BACKEND), x)


def test_packed_stream_layout_bf16_small():
    # 1.0, 2.0, largest finite, smallest subnormal, 3.0 at scattered positions.
    patterns = [0x3F80, 0x4000, 0x7F7F, 0x0001, 0x4040]
    flat = [0] * 50
    for p, v in zip([2, 3, 17, 33, 49], patterns):
        flat[p] = v
    x = from_patterns(flat, torch.bfloat16)
    c = compress(x, sign_pack=True, backend=BACKEND)
    assert int(c.tile_words[0]) & 0xFFFFFFFF == PACKED_TILE_FLAG  # packed, offset 0
    assert c.masks[0, 0] == (1 << 2) | (1 << 3) | (1 << 17) and c.masks[0, 1] == (1 << 1) | (1 << 17)
    # 5 values * 15 bits = 75 bits -> 3 words.
    acc = 0x3F80 | 0x4000 << 15 | 0x7F7F << 30 | 0x0001 << 45 | 0x4040 << 60
    expected = [acc & 0xFFFFFFFF, (acc >> 32) & 0xFFFFFFFF, (acc >> 64) & 0xFFFFFFFF]
    assert [int(w) & 0xFFFFFFFF for w in c.values.words[:3]] == expected
    assert int(c.values.cursor) == 3
    assert_bitwise_equal(decompress(c), x)


@pytest.mark.parametrize("tile_size", [32, 256, 65536])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=dtype_id)
def test_other_geometries(tile_size, dtype):
    g = TileGeometry(tile_size)
    numel = 3 * tile_size + 17 if tile_size < 65536 else 70_000
    for specials, sign_pack in ((True, False), (True, True), (False, True)):
        x = make_input(numel, dtype, 0.7, generator(tile_size, dtype, specials), specials=specials)
        c, _ = roundtrip(x, sign_pack, geometry=g)
        assert c.masks.shape == (math.ceil(numel / tile_size), tile_size // 32)
        if not specials:
            assert (c.tile_words < 0).all()


# --------------------------------------------------------------------------------------------
# Shared value buffers


def _several_tensors():
    g = generator("several")
    return [
        (make_input(5000, torch.bfloat16, 0.5, g), True),
        (make_input(4096, torch.float32, 0.9, g, specials=False), True),
        (make_input(1, torch.float16, 0.0, g), False),
        (torch.zeros(3000, dtype=torch.float8_e5m2), True),
        (make_input(3 * 4096 + 17, torch.float8_e4m3fn, 0.3, g).view(23, -1), False),
        (make_input(20000, torch.bfloat16, 0.999, g), True),
    ]


def test_shared_value_buffer():
    tensors = _several_tensors()
    capacity = sum(TileGeometry().max_stream_words(x.numel(), x.element_size() * 8) for x, _ in tensors)
    buf = ValueBuffer(capacity)
    assert buf.capacity == capacity and buf.words.numel() == capacity + 1
    assert buf.device == torch.device("cpu") and int(buf.cursor) == 0
    cs, end = [], 0
    for x, sign_pack in tensors:
        c = compress(x, sign_pack=sign_pack, values=buf, backend=BACKEND)
        assert c.values is buf
        assert int(c.base) == end
        end += int(c.stream_words())
        assert int(buf.cursor) == end
        cs.append(c)
    for c, (x, sign_pack) in zip(cs, tensors):
        assert c.fits()
        check_against_reference(c, x, sign_pack)
        assert_bitwise_equal(decompress(c, backend=BACKEND), x)
    assert int(buf.cursor) == sum(int(c.stream_words()) for c in cs) < capacity
    buf.reset()
    assert int(buf.cursor) == 0
    c = compress(tensors[0][0], values=buf, backend=BACKEND)
    assert int(c.base) == 0 and c.fits()
    assert_bitwise_equal(decompress(c), tensors[0][0])


@pytest.mark.parametrize("spare", [0, 1, 700], ids=lambda s: f"spare{s}")
def test_too_small_buffer_never_corrupts_earlier_streams(spare):
    g = generator("small", spare)
    a = make_input(3 * 4096 + 5, torch.bfloat16, 0.5, g)
    b = make_input(4 * 4096, torch.float32, 0.2, g)  # needs far more than `spare` words
    small = torch.ones(3, dtype=torch.float16)  # 2 words
    ca_words = int(compress(a, backend=BACKEND).stream_words())
    buf = ValueBuffer(ca_words + spare)
    buf.words.fill_(0x5A5A5A5A)
    ca = compress(a, values=buf, backend=BACKEND)
    assert ca.fits() and int(buf.cursor) == ca_words
    snapshot = buf.words.clone()
    cb = compress(b, values=buf, backend=BACKEND)
    assert not cb.fits()
    b_words = int(cb.stream_words())
    assert int(buf.cursor) == ca_words + b_words > buf.capacity  # the cursor still advances
    # Nothing below the end of a's stream changed, and nothing but the guard past capacity.
    assert torch.equal(buf.words[:ca_words], snapshot[:ca_words])
    assert ca.fits()
    assert_bitwise_equal(decompress(ca, backend=BACKEND), a)
    check_against_reference(ca, a, False)
    # Once the buffer overflowed, later tensors do not fit either (even tiny ones).
    cs = compress(small, values=buf, backend=BACKEND)
    assert not cs.fits()
    assert torch.equal(buf.words[:ca_words], snapshot[:ca_words])
    assert_bitwise_equal(decompress(ca, backend=BACKEND), a)


def test_zero_capacity_buffer():
    buf = ValueBuffer(0)
    assert buf.capacity == 0 and buf.words.numel() == 1
    zeros = torch.zeros(5000, dtype=torch.bfloat16)
    c = compress(zeros, values=buf, backend=BACKEND)
    assert c.fits() and c.nnz() == 0 and c.nbytes == 2 * 516
    assert_bitwise_equal(decompress(c), zeros)
    one = torch.zeros(5000, dtype=torch.bfloat16)
    one[17] = 1.0
    c = compress(one, values=buf, backend=BACKEND)
    assert not c.fits()


# --------------------------------------------------------------------------------------------
# Property tests


MAX_NUMEL = 20000


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    bits = dtype_spec(dtype).bits
    ndim = draw(st.integers(0, 3))
    shape, budget = [], MAX_NUMEL
    for _ in range(ndim):
        d = draw(st.integers(0, min(budget, 5000)))
        shape.append(d)
        budget = budget // max(d, 1)
    numel = math.prod(shape)
    kind = draw(st.sampled_from(["random_bits", "nonnegative_bits", "relu", "relu_specials"]))
    zero_fraction = draw(st.sampled_from([0.0, 0.5, 0.9, 0.999, 1.0]) | st.floats(0, 1))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    if kind.startswith("relu"):
        x = make_input(numel, dtype, zero_fraction, g, specials=kind == "relu_specials")
    else:
        u = to_unsigned_numpy(random_bits(numel, dtype, g)).copy()
        if kind == "nonnegative_bits":
            u &= (1 << (bits - 1)) - 1
        u[torch.rand(numel, generator=g).numpy() < zero_fraction] = 0
        x = from_patterns(u, dtype)
    # Explicit raw bit patterns at drawn positions: any NaN payload, subnormal, sign.
    if numel:
        overrides = draw(
            st.lists(st.tuples(st.integers(0, numel - 1), st.integers(0, 2**bits - 1)), max_size=24)
        )
        if overrides:
            u = to_unsigned_numpy(x).copy()
            for i, p in overrides:
                u[i] = p
            x = from_patterns(u, dtype)
    x = x.reshape(shape)
    if ndim >= 2 and draw(st.booleans()):
        x = x.transpose(0, -1)
    return x


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=tensors(),
    sign_pack=st.booleans(),
    tile_size=st.sampled_from([32, 256, 4096]),
)
def test_property_roundtrip(x, sign_pack, tile_size):
    roundtrip(x, sign_pack, geometry=TileGeometry(tile_size))


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    patterns=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=300),
    sign_pack=st.booleans(),
)
def test_property_arbitrary_patterns(dtype, patterns, sign_pack):
    """Raw integers drawn by hypothesis, viewed as the float dtype."""
    bits = dtype_spec(dtype).bits
    x = from_patterns([p & ((1 << bits) - 1) for p in patterns], dtype)
    roundtrip(x, sign_pack, geometry=TileGeometry(64))
    np.testing.assert_array_equal(to_unsigned_numpy(decompress(compress(x))), to_unsigned_numpy(x))


# --------------------------------------------------------------------------------------------
# Arena hooks: caller-provided fixed words, nonzero counter, ValueBuffer.wrap


def test_nonzeros_counter():
    g = generator("nonzeros")
    xs = [make_input(n, dt, 0.7, g) for n, dt in ((5000, torch.bfloat16), (1, torch.float32), (0, torch.float16))]
    counter = torch.full((1,), 11, dtype=torch.int64)
    total = 11
    for x in xs:
        c = compress_with(x, BACKEND, sign_pack=True, nonzeros=counter)
        total += c.nnz()
        assert int(counter) == total
    assert total == 11 + sum(int((int_view(x) != 0).sum()) for x in xs)


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_fixed_words(sign_pack):
    x = make_input(3 * 4096 + 17, torch.float16, 0.5, generator("fixed")).view(-1, 107)
    g = TileGeometry()
    n = g.fixed_nbytes(x.numel()) // 4
    assert n == 4 * (128 + 1)
    fixed = torch.full((n,), 0x5A5A5A5A, dtype=torch.int32)
    c = compress_with(x, BACKEND, sign_pack=sign_pack, fixed=fixed)
    # The masks, then the tile words, live in the given words.
    assert c.masks.data_ptr() == fixed.data_ptr()
    assert c.tile_words.data_ptr() == fixed.data_ptr() + 4 * 4 * 128
    assert torch.equal(fixed[: 4 * 128], c.masks.flatten()) and torch.equal(fixed[4 * 128 :], c.tile_words)
    check_against_reference(c, x, sign_pack)
    assert_bitwise_equal(decompress(c, backend=BACKEND), x)


def test_successive_appends_report_their_ends():
    check_successive_appends(BACKEND)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
def test_decode_writes_the_square(dtype):
    """The square a decode can write alongside is torch.square's, for every bit pattern,
    in the tensor's shape (the hooks restore a ReLU output and its square in one pass)."""
    g = generator("square", dtype)
    x = random_bits(3 * 4096 + 17, dtype, g).view(1, -1)
    x.view(dtype_spec(dtype).bits_dtype)[torch.rand(x.shape, generator=g) < 0.5] = 0
    value, square = decompress_with(compress(x, backend=BACKEND), get_codec(BACKEND, x.device), square=True)
    assert value.shape == square.shape == x.shape
    assert_bitwise_equal(value, x)
    assert_bitwise_equal(square, torch.square(x))


def relu_square_backward_case(dtype: torch.dtype, seed, numel: int = 3 * 4096 + 18):
    """The input ``x`` of a ReLU (``relu_square_input``), its ReLU ``r`` and a gradient of
    random bits, with NaNs, infinities and zeros of both signs among them."""
    x = relu_square_input(dtype, seed, numel)
    r = below_zero_cleared(x)
    grad = random_bits(r.numel(), dtype, generator("relu_square_backward", dtype, seed))
    grad[7:12] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1.0], dtype=dtype)
    x[7:12] = r[7:12] = 1.0
    return x, r, grad


def check_relu_square_backward(r, grad, square, grad_input):
    """``square`` and ``grad_input`` are ``r ** 2`` and ``where(r <= 0, 0, grad * (r * 2))``,
    each computed in float32 and rounded once to the dtype (modelled here through exact
    products in float64), NaNs where those are NaN."""
    wide = r.float()
    product = (grad.double() * (wide * 2).double()).float()  # exact in float64, then rounded once
    expected = torch.where(wide <= 0, 0.0, product).to(r.dtype)
    numbers = ~torch.isnan(expected)
    assert_bitwise_equal(grad_input[numbers], expected[numbers])
    assert torch.isnan(grad_input[~numbers]).all()
    assert int((r == 0).sum()) and int((~numbers).sum()) and int(torch.isinf(expected).sum())
    squared = (wide.double() ** 2).float().to(r.dtype)
    numbers = ~torch.isnan(squared)
    assert_bitwise_equal(square[numbers], squared[numbers])
    assert torch.isnan(square[~numbers]).all()


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", SQUARE_DTYPES, ids=dtype_id)
def test_decode_writes_the_relu_square_backward(dtype, sign_pack):
    """``decode`` with ``square_grad``, for a ReLU output (zeros of both signs, NaNs,
    infinities, subnormals) and a gradient of random bits (every class among them): the
    square, and the ReLU input's gradient in the output's place."""
    _, r, grad = relu_square_backward_case(dtype, ("decode", sign_pack))
    c = compress(r, sign_pack=sign_pack, backend=BACKEND)
    check_relu_square_backward(r, grad, *decode_relu_square_backward(c, BACKEND, grad))


@pytest.mark.parametrize("relu_input", [False, True], ids=["relu_output", "relu_input"])
@pytest.mark.parametrize("dtype", SQUARE_DTYPES, ids=dtype_id)
def test_relu_square_backward_of_a_dense_tensor(dtype, relu_input):
    """``relu_square_backward`` (what a tensor kept dense takes) writes the same, from the
    ReLU's output or, with ``relu_input``, its input; the tensor is large enough to be done
    in pieces."""
    x, r, grad = relu_square_backward_case(dtype, "dense", numel=3 * 65536 + 18)
    square, grad_input = torch.empty_like(r), torch.empty_like(r)
    get_codec(BACKEND, r.device).relu_square_backward(x if relu_input else r, grad, square, grad_input, relu_input)
    check_relu_square_backward(r, grad, square, grad_input)


def test_value_buffers_over_shared_counters_share_a_cursor():
    words = torch.full((1001,), 0x5A5A5A5A, dtype=torch.int32)
    counters = torch.zeros(3, dtype=torch.int64)
    a, b = ValueBuffer.over(words, counters), ValueBuffer.over(words, counters)
    assert a.capacity == b.capacity == 1000 and a.words is words
    cursor = counters[:1]
    assert a.cursor.data_ptr() == b.cursor.data_ptr() == cursor.data_ptr()
    g = generator("wrap")
    xa = make_input(1500, torch.bfloat16, 0.4, g)
    xb = make_input(700, torch.float32, 0.5, g)
    ca = compress(xa, values=a, backend=BACKEND)
    cb = compress(xb, values=b, backend=BACKEND)
    assert int(cb.base) == int(ca.stream_words()) == 450
    assert int(cursor) == 450 + int(cb.stream_words())
    for c, x in ((ca, xa), (cb, xb)):
        assert c.fits()
        check_against_reference(c, x, False)
        assert_bitwise_equal(decompress(c, backend=BACKEND), x)


# --------------------------------------------------------------------------------------------
# Shared buffers: threads, overflow, reset; read-only compressed tensors


def test_threads_sharing_a_value_buffer_store_every_tensor_exactly():
    g = generator("threads")
    tensors = [make_input(int(n), torch.float32, 0.5, g) for n in torch.randint(1, 20000, (400,), generator=g)]
    buf = ValueBuffer(sum(TileGeometry().max_stream_words(x.numel(), 32) for x in tensors))
    results: list = [None] * len(tensors)

    def worker(first: int) -> None:
        for i in range(first, len(tensors), 4):
            results[i] = compress(tensors[i], values=buf, backend=BACKEND)

    import threading

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ends = sorted((int(c.base), int(c.base + c.stream_words())) for c in results)
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:])), "two appends overlap"
    for c, x in zip(results, tensors):
        assert c.fits()
        assert_bitwise_equal(decompress(c, backend=BACKEND), x)


def test_decompress_refuses_a_tensor_whose_values_did_not_fit():
    x = make_input(40000, torch.float32, 0.5, generator("overflow"))
    c = compress(x, values=ValueBuffer(100), backend=BACKEND)
    assert not c.fits()
    with pytest.raises(ValueError, match="did not fit its ValueBuffer"):
        decompress(c, backend=BACKEND)


def test_decompress_refuses_a_tensor_of_a_buffer_reset_since():
    g = generator("reset")
    x, y = make_input(5000, torch.float32, 0.5, g), make_input(5000, torch.float32, 0.3, g)
    buf = ValueBuffer(10000)
    c = compress(x, values=buf, backend=BACKEND)
    buf.reset()
    compress(y, values=buf, backend=BACKEND)  # overwrites x's values
    with pytest.raises(ValueError, match="was reset since"):
        decompress(c, backend=BACKEND)


def test_a_compressed_tensor_is_read_only_and_checked():
    import dataclasses

    x = make_input(3 * 4096 + 5, torch.bfloat16, 0.5, generator("frozen"))
    c = compress(x, backend=BACKEND)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.shape = torch.Size([4 * 4096])
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dtype = torch.float16
    wrong = dataclasses.replace(c, shape=torch.Size([8 * 4096]))
    with pytest.raises(ValueError, match="inconsistent"):
        decompress(wrong, backend=BACKEND)
    assert_bitwise_equal(decompress(c, backend=BACKEND), x)


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_measure_moves_the_cursor_as_encode_does(dtype, sign_pack):
    g = generator("measure", dtype, sign_pack)
    xs = [make_input(n, dtype, z, g) for n, z in ((5000, 0.5), (1, 0.0), (3 * 4096, 0.9), (4096, 1.0))]
    codec = get_codec(BACKEND, torch.device("cpu"))
    counters = torch.zeros(3, dtype=torch.int64)
    for x in xs:
        before = int(counters[0])
        report = torch.zeros(1, dtype=torch.int64)
        codec.measure(x, counters[:1], counters[1:], dtype_spec(dtype), TileGeometry(), sign_pack, report)
        words = int(compress(x, sign_pack=sign_pack, backend=BACKEND).stream_words())
        assert int(counters[0]) - before == words
        assert int(report) == int(counters[0]) + 1
        assert counters[1:].tolist() == [0, 0]


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_measure_tiles_gives_each_tile_the_words_encode_gives_it(dtype, sign_pack):
    """Each tile's words are those of the tile compressed alone; nothing else is written."""
    g = generator("measure_tiles", dtype, sign_pack)
    x = make_input(4 * 4096 + 5, dtype, 0.6, g)
    x[4096 : 2 * 4096] = 0  # a tile with nothing to store
    codec = get_codec(BACKEND, torch.device("cpu"))
    tile_words = torch.full((6,), -7, dtype=torch.int32)
    codec.measure_tiles(x, tile_words[:5], dtype_spec(dtype), TileGeometry(), sign_pack)
    alone = [int(compress(tile, sign_pack=sign_pack, backend=BACKEND).stream_words()) for tile in x.split(4096)]
    assert tile_words.tolist() == alone + [-7] and alone[1] == 0


def relu_square_input(dtype: torch.dtype, seed, numel: int = 3 * 4096 + 18) -> torch.Tensor:
    """Random bit patterns (every sign, NaN payload and subnormal), half of them zeros, and
    -0.0, NaNs of both signs and both infinities among them."""
    g = generator("relu_square", dtype, seed)
    x = random_bits(numel, dtype, g)
    x.view(dtype_spec(dtype).bits_dtype)[torch.rand(x.numel(), generator=g) < 0.5] = 0
    x[:6] = torch.tensor([-0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), -1.0], dtype=dtype)
    return x


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", SQUARE_DTYPES, ids=dtype_id)
def test_relu_square_stores_the_relu_and_writes_its_square(dtype, sign_pack):
    """``encode`` with ``relu_square`` stores what ``compress`` stores for ``x`` with every
    element below zero cleared (-0.0 and NaNs kept), in as many bytes, and writes its square
    as float32 arithmetic rounds it; ``measure`` claims the same words and writes the same
    square."""
    x = relu_square_input(dtype, sign_pack)
    relu = below_zero_cleared(x)
    assert int_view(relu)[:5].tolist() == int_view(x)[:3].tolist() + [int_view(x)[3].item(), 0]
    c, square = compress_relu_of(x, BACKEND, sign_pack)
    assert_bitwise_equal(decompress(c, backend=BACKEND), relu)
    plain = compress(relu, sign_pack=sign_pack, backend=BACKEND)
    assert torch.equal(c.masks, plain.masks) and c.nbytes == plain.nbytes
    numbers = ~torch.isnan(relu)
    assert_bitwise_equal(square[numbers], (relu[numbers].double() ** 2).to(dtype))  # exact, then rounded once
    assert torch.isnan(square[~numbers]).all()

    counters = torch.zeros(3, dtype=torch.int64)
    measured = torch.empty_like(x)
    codec = get_codec(BACKEND, x.device)
    codec.measure(x, counters[:1], counters[1:], dtype_spec(dtype), TileGeometry(), sign_pack, relu_square=measured)
    assert int(counters[0]) == int(plain.stream_words())
    assert_bitwise_equal(measured, square)
    tile_words = torch.empty(TileGeometry().num_tiles(x.numel()), dtype=torch.int32)
    measured = torch.empty_like(x)
    codec.measure_tiles(x, tile_words, dtype_spec(dtype), TileGeometry(), sign_pack, relu_square=measured)
    assert int(tile_words.sum()) == int(plain.stream_words())
    assert_bitwise_equal(measured, square)
