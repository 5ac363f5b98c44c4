"""The Triton backend on CPU tensors, under Triton's interpreter (``TRITON_INTERPRET=1``).

``tests/conftest.py`` switches the interpreter on when there is no CUDA. With CUDA these
tests are skipped: ``tests/test_gpu_codec.py`` runs the compiled kernels there. The
interpreter runs about 1-3 million elements a second, so the sizes stay small.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("CUDA is available: test_gpu_codec.py covers the triton backend", allow_module_level=True)

from helpers import (  # noqa: E402
    DTYPES,
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
    to_unsigned_numpy,
)

from bitsparse import TileGeometry, ValueBuffer, compress, decompress  # noqa: E402
from bitsparse.codecs import get_codec, torch_codec, triton_codec  # noqa: E402
from bitsparse.compressed import decompress_with  # noqa: E402
from bitsparse.format import dtype_spec  # noqa: E402

if not triton_codec.INTERPRETED:
    pytest.skip(
        "the triton kernels are not interpreted (TRITON_INTERPRET is off) and there is no CUDA",
        allow_module_level=True,
    )

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from the interpreter

BACKENDS = ("triton", "torch")
SIZES = [1, 4095, 4097, 3 * 4096 + 17, 40000]
ZERO_FRACTIONS = [0.0, 0.5, 0.9, 1.0]


def encode_both(x, sign_pack, geometry=TileGeometry()):
    """Compress with both backends; check both against the reference and against each other."""
    ct = compress(x, sign_pack=sign_pack, backend="triton", geometry=geometry)
    cr = compress(x, sign_pack=sign_pack, backend="torch", geometry=geometry)
    check_against_reference(ct, x, sign_pack, geometry)
    check_against_reference(cr, x, sign_pack, geometry)
    assert torch.equal(ct.masks, cr.masks)
    assert torch.equal(ct.tile_words < 0, cr.tile_words < 0)
    assert ct.nbytes == cr.nbytes
    assert ct.nnz() == cr.nnz()
    assert int(ct.values.cursor) == int(cr.values.cursor) == int(ct.stream_words())
    return {"triton": ct, "torch": cr}


def cross_decode(encoded, x):
    """All four encoder x decoder combinations restore ``x`` bit for bit."""
    for enc, c in encoded.items():
        for dec in BACKENDS:
            y = decompress(c, backend=dec)
            assert y.is_contiguous() and not y.requires_grad
            try:
                assert_bitwise_equal(y, x)
            except AssertionError as e:
                raise AssertionError(f"encoded with {enc}, decoded with {dec}: {e}") from None


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("numel", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("zero_fraction", ZERO_FRACTIONS, ids=lambda z: f"z{z}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_roundtrip_and_cross_decode(dtype, zero_fraction, numel, sign_pack):
    x = make_input(numel, dtype, zero_fraction, generator("triton", dtype, zero_fraction, numel))
    cross_decode(encode_both(x, sign_pack), x)


@pytest.mark.parametrize("numel", [4097, 40000], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("zero_fraction", [0.0, 0.5, 0.9], ids=lambda z: f"z{z}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_signpack_without_specials_packs_every_tile(dtype, zero_fraction, numel):
    x = make_input(numel, dtype, zero_fraction, generator("plain", dtype, zero_fraction, numel), specials=False)
    encoded = encode_both(x, sign_pack=True)
    assert (encoded["triton"].tile_words < 0).all()
    cross_decode(encoded, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_mixed_packed_and_raw_tiles(dtype):
    x = make_input(6 * 4096, dtype, 0.5, generator("mixed", dtype), specials=False)
    bits = x.view(dtype_spec(dtype).bits_dtype)
    sign = torch.tensor(1 << (dtype_spec(dtype).bits - 1)).to(bits.dtype)
    bits[4096 + 9] = sign  # -0.0 in tile 1
    bits[4 * 4096 + 4095] |= sign  # a negative value at the very end of tile 4
    encoded = encode_both(x, sign_pack=True)
    assert (encoded["triton"].tile_words < 0).tolist() == [True, False, True, True, False, True]
    cross_decode(encoded, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_random_bit_patterns(dtype, sign_pack):
    """Every bit pattern (NaN payloads, subnormals, signs), half of them zeroed."""
    g = generator("random", dtype)
    x = random_bits(3 * 4096 + 17, dtype, g)
    x.view(dtype_spec(dtype).bits_dtype)[torch.rand(x.numel(), generator=g) < 0.5] = 0
    cross_decode(encode_both(x, sign_pack), x)


def test_decode_writes_the_square():
    """The square a decode can write alongside is torch.square's, for every float32 bit
    pattern. Only float32 here: the interpreter rounds float32 to bfloat16 by truncation and
    makes other NaNs than the GPU; ``test_gpu_codec.py`` checks the 16-bit dtypes compiled."""
    g = generator("square", torch.float32)
    x = random_bits(3 * 4096 + 17, torch.float32, g)
    x.view(torch.int32)[torch.rand(x.numel(), generator=g) < 0.5] = 0
    value, square = decompress_with(compress(x, backend="triton"), get_codec("triton", x.device), square=True)
    assert_bitwise_equal(value, x)
    assert_bitwise_equal(square, torch.square(x))


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_decode_writes_the_relu_square_backward(dtype, sign_pack):
    """``decode`` with ``square_grad``, and ``relu_square_backward`` of the dense ReLU output
    or input, write the torch codec's bits, for a ReLU output and a gradient of random bits,
    zeros of both signs among them, but for the payloads of the NaNs they compute (numpy's
    here). Float16 and float32 only: the interpreter rounds to bfloat16 by truncation;
    ``test_gpu_codec.py`` checks every dtype compiled."""
    g = generator("relu_square_backward-triton", dtype, sign_pack)
    r = below_zero_cleared(random_bits(3 * 4096 + 18, dtype, g))
    r.view(dtype_spec(dtype).bits_dtype)[torch.rand(r.numel(), generator=g) < 0.5] = 0
    r[:2] = torch.tensor([-0.0, 1.0], dtype=dtype)
    grad = random_bits(r.numel(), dtype, g)
    c = compress(r, sign_pack=sign_pack, backend="torch")
    decoded = [decode_relu_square_backward(c, backend, grad) for backend in ("triton", "torch")]
    x = r.clone()
    x[r == 0] = -1.0  # as a ReLU's input
    dense = []
    for codec, relu_input in ((triton_codec, False), (triton_codec, True), (torch_codec, False)):
        square, grad_input = torch.empty_like(r), torch.empty_like(r)
        codec.relu_square_backward(x if relu_input else r, grad, square, grad_input, relu_input)
        dense.append((square, grad_input))
    (square_r, grad_input_r), *others = [decoded[1], decoded[0], *dense]
    numbers = ~torch.isnan(grad_input_r)
    for square, grad_input in others:
        assert_bitwise_equal(square, square_r)
        assert_bitwise_equal(grad_input[numbers], grad_input_r[numbers])
        assert torch.isnan(grad_input[~numbers]).all()


@pytest.mark.parametrize("tile_size", [32, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_other_geometry(tile_size, dtype):
    g = TileGeometry(tile_size)
    numel = 9 * tile_size + 17  # ten tiles: three programs of the sign-packing encoder loop four times
    for specials, sign_pack in ((True, False), (True, True), (False, True)):
        x = make_input(numel, dtype, 0.6, generator("geom", tile_size, dtype, specials), specials=specials)
        encoded = encode_both(x, sign_pack, geometry=g)
        assert encoded["triton"].masks.shape == (math.ceil(numel / tile_size), tile_size // 32)
        cross_decode(encoded, x)


@pytest.mark.parametrize(
    "shape", [(), (0,), (0, 5), (7, 13), (2, 3, 4097)], ids=lambda s: "x".join(map(str, s)) or "scalar"
)
def test_shapes(shape):
    x = make_input(math.prod(shape), torch.bfloat16, 0.5, generator("shape", shape)).reshape(shape)
    for sign_pack in (False, True):
        cross_decode(encode_both(x, sign_pack), x)


def test_requires_grad():
    x = make_input(5000, torch.float16, 0.5, generator("grad")).view(50, 100).requires_grad_()
    c = compress(x * 2, backend="triton")
    y = decompress(c, backend="triton")
    assert not y.requires_grad and y.grad_fn is None
    assert_bitwise_equal(y, (x * 2).detach())


def _strided(case):
    base = make_input(6 * 4096 + 40, torch.bfloat16, 0.6, generator("strided"))
    m = base[: 96 * 256].view(96, 256)
    return {
        "transposed": lambda: m.t(),
        "step_slice_2d": lambda: m[::2, 1::3],
        "expanded_row": lambda: m[4].expand(40, 256),
        "broadcast_unsqueeze": lambda: base[:300].unsqueeze(0).expand(3, 7, 300),
        "step_slice_1d": lambda: base[3::3],
        "column": lambda: m[:, 5],
        "expanded_scalar": lambda: base[7:8].view(()).expand(5000),
    }[case]()


@pytest.mark.parametrize(
    "case",
    [
        "transposed",
        "step_slice_2d",
        "expanded_row",
        "broadcast_unsqueeze",
        "step_slice_1d",
        "column",
        "expanded_scalar",
    ],
)
def test_non_contiguous_inputs(case):
    x = _strided(case)
    assert not x.is_contiguous()
    for sign_pack in (False, True):
        y = decompress(compress(x, sign_pack=sign_pack, backend="triton"), backend="torch")
        assert_bitwise_equal(y, x.contiguous())


def test_shared_value_buffer_mixing_backends():
    g = generator("shared")
    items = [
        (make_input(5000, torch.bfloat16, 0.5, g), True, "triton"),
        (make_input(4096, torch.float32, 0.9, g, specials=False), True, "torch"),
        (make_input(1, torch.float16, 0.0, g), False, "triton"),
        (torch.zeros(3000, dtype=torch.float8_e5m2), True, "triton"),
        (make_input(3 * 4096 + 17, torch.float8_e4m3fn, 0.3, g), False, "torch"),
        (make_input(20000, torch.bfloat16, 0.9, g, specials=False), True, "triton"),
        (make_input(9000, torch.float8_e5m2, 0.5, g), True, "triton"),
    ]
    capacity = sum(TileGeometry().max_stream_words(x.numel(), x.element_size() * 8) for x, _, _ in items)
    buf = ValueBuffer(capacity)
    cs, end = [], 0
    for x, sign_pack, backend in items:
        c = compress(x, sign_pack=sign_pack, values=buf, backend=backend)
        assert c.values is buf and int(c.base) == end
        end += int(c.stream_words())
        assert int(buf.cursor) == end
        cs.append(c)
    for c, (x, sign_pack, _) in zip(cs, items):
        assert c.fits()
        check_against_reference(c, x, sign_pack)
        for dec in BACKENDS:
            assert_bitwise_equal(decompress(c, backend=dec), x)


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_too_small_buffer_never_corrupts_earlier_streams(sign_pack):
    g = generator("small-triton", sign_pack)
    a = make_input(3 * 4096 + 5, torch.bfloat16, 0.5, g, specials=False)
    b = make_input(5 * 4096, torch.float32, 0.2, g, specials=False)
    a_words = int(compress(a, sign_pack=sign_pack).stream_words())
    buf = ValueBuffer(a_words + 1500)  # b's first tile fits, the rest does not
    buf.words.fill_(0x5A5A5A5A)
    ca = compress(a, sign_pack=sign_pack, values=buf, backend="triton")
    assert ca.fits() and int(buf.cursor) == a_words
    snapshot = buf.words.clone()
    cb = compress(b, sign_pack=sign_pack, values=buf, backend="triton")
    assert not cb.fits()
    assert int(buf.cursor) == a_words + int(cb.stream_words()) > buf.capacity
    assert torch.equal(buf.words[:a_words], snapshot[:a_words])
    # Masks and tile words are written even for tiles whose values did not fit.
    cr = compress(b, sign_pack=sign_pack, backend="torch")
    assert torch.equal(cb.masks, cr.masks) and torch.equal(cb.tile_words < 0, cr.tile_words < 0)
    for dec in BACKENDS:
        assert_bitwise_equal(decompress(ca, backend=dec), a)
    tiny = compress(torch.ones(3, dtype=torch.float16), values=buf, backend="triton")
    assert not tiny.fits()
    assert torch.equal(buf.words[:a_words], snapshot[:a_words])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_padding_is_zeroed(dtype):
    """A raw tile's last word holds zeros past its last value, whatever the buffer held."""
    g = generator("padding", dtype)
    for n in (1, 3, 4097, 3 * 4096 + 1):
        x = make_input(n, dtype, 0.3, g)
        for sign_pack in (False, True):
            buf = ValueBuffer(TileGeometry().max_stream_words(n, dtype_spec(dtype).bits))
            buf.words.fill_(0x5A5A5A5A)
            c = compress(x, sign_pack=sign_pack, values=buf, backend="triton")
            check_against_reference(c, x, sign_pack, zero_padding=True)


def test_nonzeros_counter_and_fixed_words():
    g = generator("arena-triton")
    counter = torch.zeros(1, dtype=torch.int64)
    total = 0
    cases = ((5000, torch.bfloat16, True), (4096, torch.float8_e5m2, False), (1, torch.float32, True))
    for n, dtype, sign_pack in cases:
        x = make_input(n, dtype, 0.6, g)
        fixed = torch.full((TileGeometry().fixed_nbytes(n) // 4,), -1, dtype=torch.int32)
        c = compress_with(x, "triton", sign_pack=sign_pack, nonzeros=counter, fixed=fixed)
        assert c.masks.data_ptr() == fixed.data_ptr()
        total += int((int_view(x) != 0).sum())
        assert int(counter) == total
        check_against_reference(c, x, sign_pack)
        assert_bitwise_equal(decompress(c, backend="triton"), x)


def test_successive_appends_report_their_ends():
    check_successive_appends("triton")


def test_stream_bit_layout_packed_bf16():
    """Value k of a packed tile at bits [15k, 15k + 15) of its words (Python ints)."""
    patterns = [0x3F80, 0x4000, 0x7F7F, 0x0001, 0x4040, 0x7FC0, 0x7F80]
    flat = [0] * 100
    for p, v in zip([2, 3, 17, 33, 49, 64, 99], patterns):
        flat[p] = v
    x = from_patterns(flat, torch.bfloat16)
    c = compress(x, sign_pack=True, backend="triton")
    acc = sum(v << (15 * k) for k, v in enumerate(patterns))
    n = math.ceil(len(patterns) * 15 / 32)
    assert int(c.tile_words[0]) & 0xFFFFFFFF == 0x80000000
    assert [int(w) & 0xFFFFFFFF for w in c.values.words[:n]] == [
        (acc >> (32 * w)) & 0xFFFFFFFF for w in range(n)
    ]
    assert_bitwise_equal(decompress(c, backend="triton"), x)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    numel=st.integers(0, 5000),
    zero_fraction=st.floats(0, 1),
    nonnegative=st.booleans(),
    sign_pack=st.booleans(),
    tile_size=st.sampled_from([32, 256, 4096]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_cross_decode(dtype, numel, zero_fraction, nonnegative, sign_pack, tile_size, seed):
    g = torch.Generator().manual_seed(seed)
    bits = dtype_spec(dtype).bits
    u = to_unsigned_numpy(random_bits(numel, dtype, g)).copy()
    if nonnegative:
        u &= (1 << (bits - 1)) - 1
    u[torch.rand(numel, generator=g).numpy() < zero_fraction] = 0
    x = from_patterns(u, dtype)
    cross_decode(encode_both(x, sign_pack, TileGeometry(tile_size)), x)
    assert int_view(x).numel() == numel


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_measure_moves_the_cursor_as_encode_does(dtype, sign_pack):
    """The Triton measure claims exactly the words the encoder appends, as the torch one does."""
    g = generator("measure-triton", dtype, sign_pack)
    xs = [make_input(n, dtype, z, g) for n, z in ((5000, 0.5), (1, 0.0), (9 * 4096 + 3, 0.9), (4096, 1.0), (0, 0.0))]
    for codec in (triton_codec, torch_codec):
        counters = torch.zeros(3, dtype=torch.int64)
        for x in xs:
            before = int(counters[0])
            report = torch.zeros(1, dtype=torch.int64)
            codec.measure(x, counters[:1], counters[1:], dtype_spec(dtype), TileGeometry(), sign_pack, report)
            words = int(compress(x, sign_pack=sign_pack, backend="triton").stream_words()) if x.numel() else 0
            assert int(counters[0]) - before == words
            assert int(report) == int(counters[0]) + 1
            assert counters[1:].tolist() == [0, 0]


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_measure_tiles_matches_the_reference(dtype, sign_pack):
    """The Triton ``measure_tiles`` writes the torch codec's words for every tile, the last
    one partial, and nothing past them."""
    g = generator("measure_tiles-triton", dtype, sign_pack)
    for numel, zeros in ((9 * 4096 + 3, 0.9), (5000, 0.5), (1, 0.0), (4096, 1.0)):
        x = make_input(numel, dtype, zeros, g)
        tiles = TileGeometry().num_tiles(numel)
        words = torch.full((2, tiles + 1), -7, dtype=torch.int32)
        for codec, row in zip((triton_codec, torch_codec), words):
            codec.measure_tiles(x, row[:tiles], dtype_spec(dtype), TileGeometry(), sign_pack)
        assert torch.equal(words[0], words[1]) and int(words[0, -1]) == -7
        assert int(words[0, :tiles].sum()) == int(compress(x, sign_pack=sign_pack, backend="torch").stream_words())


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
def test_relu_square_matches_the_reference(dtype, sign_pack):
    """The Triton encoder's and measure's ``relu_square``: the ReLU stored as the torch codec
    stores it (each decodes the other's), and the same square, except for bfloat16, which the
    interpreter rounds by truncation and whose subnormals it flushes to zero when it widens
    them (so none is given here; ``test_gpu_codec.py`` checks them compiled)."""
    g = generator("relu_square-triton", dtype, sign_pack)
    x = random_bits(3 * 4096 + 18, dtype, g)
    bits = x.view(dtype_spec(dtype).bits_dtype)
    bits[torch.rand(x.numel(), generator=g) < 0.5] = 0
    if dtype == torch.bfloat16:
        bits[(bits & 0x7F80) == 0] = 0
    relu = below_zero_cleared(x)
    (ct, square_t), (cr, square_r) = (compress_relu_of(x, backend, sign_pack) for backend in ("triton", "torch"))
    assert torch.equal(ct.masks, cr.masks) and torch.equal(ct.tile_words < 0, cr.tile_words < 0)
    assert ct.nbytes == cr.nbytes
    for c in (ct, cr):
        for backend in ("triton", "torch"):
            assert_bitwise_equal(decompress(c, backend=backend), relu)
    if dtype != torch.bfloat16:
        assert_bitwise_equal(square_t, square_r)
    counters = torch.zeros(3, dtype=torch.int64)
    measured = torch.empty_like(x)
    spec = dtype_spec(dtype)
    triton_codec.measure(x, counters[:1], counters[1:], spec, TileGeometry(), sign_pack, relu_square=measured)
    assert int(counters[0]) == int(cr.stream_words())
    assert_bitwise_equal(measured, square_t)
    tile_words = torch.empty((2, TileGeometry().num_tiles(x.numel())), dtype=torch.int32)
    for codec, words in zip((triton_codec, torch_codec), tile_words):
        measured = torch.empty_like(x)
        codec.measure_tiles(x, words, spec, TileGeometry(), sign_pack, relu_square=measured)
        if codec is triton_codec or dtype != torch.bfloat16:
            assert_bitwise_equal(measured, square_t)
    assert torch.equal(tile_words[0], tile_words[1]) and int(tile_words[0].sum()) == int(cr.stream_words())
