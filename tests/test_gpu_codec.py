"""The Triton backend on CUDA at large sizes (skipped without a CUDA device).

Run just these with ``python -m pytest -m gpu``. At these sizes the NumPy reference in
``helpers.py`` would be slow, so most tests check exactness of the round trip plus masks,
packed flags and sizes computed on the device (``helpers.expected_tile_stats``) and against
the torch backend; the cross-decoding test also runs the full NumPy reference at 2**22.
"""

import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    below_zero_cleared,
    check_against_reference,
    check_successive_appends,
    compress_relu_of,
    compress_with,
    decode_relu_square_backward,
    dtype_id,
    expected_tile_stats,
    make_input,
    random_bits,
    seed_of,
)

from bitsparse import TileGeometry, ValueBuffer, compress, decompress
from bitsparse.codecs import get_codec, torch_codec, triton_codec
from bitsparse.compressed import decompress_with
from bitsparse.format import compressed_nbytes, dtype_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
# The Gluon kernels run on the Triton release they were verified with (triton_codec.GLUON_TRITON).
needs_gluon = pytest.mark.skipif(not triton_codec._GLUON, reason=str(triton_codec._GLUON_WARNING))


def cuda_generator(*parts):
    return torch.Generator(device="cuda").manual_seed(seed_of(*parts))


def check_encoding(c, x, sign_pack, geometry=TileGeometry()):
    """Masks bit for bit, packed flags, nnz and nbytes, all computed on the device."""
    counts, packed = expected_tile_stats(x, sign_pack, geometry)
    spec = dtype_spec(x.dtype)
    bits = x.detach().reshape(-1).contiguous().view(spec.bits_dtype)
    num_tiles = counts.numel()
    padded = torch.zeros(num_tiles * geometry.tile_size, dtype=torch.bool, device=x.device)
    padded[: bits.numel()] = bits != 0
    weights = torch.ones(32, dtype=torch.int64, device=x.device) << torch.arange(32, device=x.device)
    masks = (padded.view(num_tiles, -1, 32).long() * weights).sum(-1)
    assert torch.equal(c.masks.long() & 0xFFFFFFFF, masks), "masks"
    assert torch.equal(c.tile_words < 0, packed), "packed flags"
    assert c.nnz() == int(counts.sum())
    assert c.nbytes == compressed_nbytes(x.numel(), spec, counts.tolist(), packed.tolist(), geometry)
    assert c.fits()


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("zero_fraction", [0.5, 0.9], ids=lambda z: f"z{z}")
@pytest.mark.parametrize("numel", [2**24, 2**26 + 12345], ids=["2^24", "2^26+12345"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=dtype_id)
def test_large_roundtrip(dtype, numel, zero_fraction, sign_pack):
    x = make_input(numel, dtype, zero_fraction, cuda_generator(dtype, numel, zero_fraction))
    c = compress(x, sign_pack=sign_pack, backend="triton")
    assert c.device == x.device
    check_encoding(c, x, sign_pack)
    if sign_pack:
        packed = c.tile_words < 0
        assert packed.any() and not packed.all()  # sparse negative specials: both encodings
    y = decompress(c, backend="triton")
    assert y.is_contiguous()
    assert_bitwise_equal(y, x)


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=dtype_id)
def test_cross_decode(dtype, sign_pack):
    numel = 2**22
    x = make_input(numel, dtype, 0.7, cuda_generator("cross", dtype)).view(2**11, 2**11)
    encoded = {b: compress(x, sign_pack=sign_pack, backend=b) for b in ("triton", "torch")}
    assert torch.equal(encoded["triton"].masks, encoded["torch"].masks)
    assert torch.equal(encoded["triton"].tile_words < 0, encoded["torch"].tile_words < 0)
    assert encoded["triton"].nbytes == encoded["torch"].nbytes
    check_against_reference(encoded["triton"], x, sign_pack)
    check_against_reference(encoded["torch"], x, sign_pack)
    for enc, c in encoded.items():
        for dec in ("triton", "torch"):
            assert_bitwise_equal(decompress(c, backend=dec), x)


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_repeated_encode(sign_pack):
    """Encode the same input 20 times: any race in the kernels would show as a difference."""
    x = make_input(2**24 + 4097, torch.bfloat16, 0.6, cuda_generator("repeat"))
    first = compress(x, sign_pack=sign_pack, backend="triton")
    check_encoding(first, x, sign_pack)
    for _ in range(20):
        c = compress(x, sign_pack=sign_pack, backend="triton")
        assert torch.equal(c.masks, first.masks)
        assert torch.equal(c.tile_words < 0, first.tile_words < 0)
        assert int(c.values.cursor) == int(first.values.cursor)
        assert_bitwise_equal(decompress(c, backend="triton"), x)


def test_many_tensors_in_one_buffer():
    g = cuda_generator("many")
    sizes = torch.randint(0, 300_000, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    items = []
    for i, n in enumerate(sizes):
        dtype = GPU_DTYPES[i % len(GPU_DTYPES)]
        items.append((make_input(n, dtype, [0.0, 0.5, 0.9, 1.0][i % 4], g, specials=i % 3 != 0), i % 2 == 0))
    capacity = sum(TileGeometry().max_stream_words(x.numel(), x.element_size() * 8) for x, _ in items)
    buf = ValueBuffer(capacity, device="cuda")
    cs = [compress(x, sign_pack=sp, values=buf, backend="triton") for x, sp in items]
    end = 0
    for c, (x, sign_pack) in zip(cs, items):
        assert int(c.base) == end
        end += int(c.stream_words())
        assert c.fits()
        assert_bitwise_equal(decompress(c, backend="triton"), x)
    assert int(buf.cursor) == end


class LaunchSpy:
    """A ``_Launcher`` that records the arguments of every launch, through Triton or direct."""

    def __init__(self, launcher):
        self.launcher, self.calls = launcher, []

    def __call__(self, grid, device, key, args):
        self.calls.append(args)
        self.launcher(grid, device, key, args)

    def ready(self, device, key):
        return self.launcher.ready(device, key)

    def launch(self, direct, grid, device, args):
        self.calls.append(args)
        self.launcher.launch(direct, grid, device, args)


def gluon_launches(monkeypatch, launchers: dict, bits: int) -> list:
    """The launches of a Gluon kernel (``launchers``: the encoders' or the decoders' per-width
    launchers) for ``bits``-bit values from now on (a list that grows)."""
    spy = LaunchSpy(launchers[bits])
    monkeypatch.setitem(launchers, bits, spy)
    return spy.calls


def gluon_encodes(monkeypatch, bits: int) -> list:
    """The Gluon encoder's launches for ``bits``-bit values from now on."""
    return gluon_launches(monkeypatch, triton_codec._gluon_encode_launchers, bits)


@needs_gluon
@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=dtype_id)
def test_gluon_and_portable_encoders_agree(dtype, sign_pack, monkeypatch):
    """The Gluon encoder serves CUDA; both encoders match the reference, tile by tile."""
    calls = gluon_encodes(monkeypatch, dtype.itemsize * 8)
    g = cuda_generator("encoders", dtype)
    buf = ValueBuffer(1 << 22, device="cuda")  # successive appends start anywhere in a 16-byte line
    cases = [(1, 0.5), (4095, 0.0), (4097, 0.9), (3 * 4096 + 17, 0.5), (2 * 4096, 1.0), (2**20 + 5, 0.999)]
    for numel, zero_fraction in cases:
        x = make_input(numel, dtype, zero_fraction, g)
        gluon = compress(x, sign_pack=sign_pack, values=buf, backend="triton")
        with monkeypatch.context() as m:
            m.setattr(triton_codec, "_GLUON", False)
            portable = compress(x, sign_pack=sign_pack, values=buf, backend="triton")
        for c in (gluon, portable):
            check_against_reference(c, x, sign_pack)
            assert_bitwise_equal(decompress(c, backend="triton"), x)
        assert torch.equal(gluon.masks, portable.masks)
        assert torch.equal(gluon.tile_words < 0, portable.tile_words < 0)
    assert len(calls) == len(cases)


@needs_gluon
@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=dtype_id)
def test_gluon_and_portable_decoders_agree(dtype, sign_pack, monkeypatch):
    """Packed streams and 8- and 16-bit values are decoded by the Gluon decoder on CUDA; both
    decoders restore every tile, raw and packed ones alike."""
    bits = dtype.itemsize * 8
    calls = gluon_launches(monkeypatch, triton_codec._gluon_decode_launchers, bits)
    g = cuda_generator("decoders", dtype, sign_pack)
    buf = ValueBuffer(1 << 22, device="cuda")
    cases = [(1, 0.5), (4097, 0.0), (3 * 4096 + 17, 0.5), (2 * 4096, 1.0), (2**20 + 5, 0.9)]
    for numel, zero_fraction in cases:
        x = make_input(numel, dtype, zero_fraction, g)
        c = compress(x, sign_pack=sign_pack, values=buf, backend="triton")
        assert_bitwise_equal(decompress(c, backend="triton"), x)
        with monkeypatch.context() as m:
            m.setattr(triton_codec, "_GLUON", False)
            assert_bitwise_equal(decompress(c, backend="triton"), x)
    assert len(calls) == (len(cases) if sign_pack or bits < 32 else 0)


def test_unaligned_stream_is_encoded_by_the_portable_encoder(monkeypatch):
    """The Gluon encoder's 16-byte stores need an aligned stream; a shifted one still works."""

    def refuse(*args):
        raise AssertionError("the Gluon encoder got an unaligned stream")

    for bits in triton_codec._gluon_encode_launchers:
        monkeypatch.setitem(triton_codec._gluon_encode_launchers, bits, refuse)
    words = torch.empty(2**20 + 2, dtype=torch.int32, device="cuda")[1:]
    buf = ValueBuffer.over(words, torch.zeros(3, dtype=torch.int64, device="cuda"))
    x = make_input(3 * 4096 + 5, torch.bfloat16, 0.5, cuda_generator("unaligned"))
    for _ in range(3):
        c = compress(x, values=buf, backend="triton")
        check_against_reference(c, x, False)
        assert_bitwise_equal(decompress(c, backend="triton"), x)


@needs_gluon
def test_unaligned_input_is_encoded_by_the_portable_encoder(monkeypatch):
    """The Gluon encoder loads the input in 16-byte vectors of words; a view that starts
    elsewhere goes to the portable encoder, with the same result."""
    calls = gluon_encodes(monkeypatch, 16)
    x = make_input(3 * 4096 + 6, torch.bfloat16, 0.5, cuda_generator("unaligned input"))[1:]
    for sign_pack in (False, True):
        c = compress(x, sign_pack=sign_pack, backend="triton")
        check_against_reference(c, x, sign_pack)
        assert_bitwise_equal(decompress(c, backend="triton"), x)
    assert not calls, "the Gluon encoder got an unaligned input"


@needs_gluon
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2], ids=dtype_id)
def test_gluon_encoder_ignores_values_past_the_end(dtype, monkeypatch):
    """The Gluon encoder loads whole 32-bit words, and the last one may hold values past the
    tensor's end: they count neither as values nor against sign packing (here negative)."""
    calls = gluon_encodes(monkeypatch, dtype.itemsize * 8)
    g = cuda_generator("past the end", dtype)
    storage = torch.rand(4096 + 4, generator=g, device="cuda").to(dtype)
    storage[4096 + 1 :] = -1.0
    x = storage[: 4096 + 1]
    for sign_pack in (False, True):
        c = compress(x, sign_pack=sign_pack, backend="triton")
        check_against_reference(c, x, sign_pack)
        assert_bitwise_equal(decompress(c, backend="triton"), x)
    assert len(calls) == 2


def test_launch_key_determines_the_compiled_kernel(monkeypatch):
    """Launches skip Triton's argument binding, reusing the kernel compiled for their key:
    for every launch, the kernel Triton itself would pick must be that one. (On a Triton whose
    launcher was not checked, every launch goes through Triton and nothing is kept.) Here every
    launch goes through ``__call__``, which checks it; the direct launches of the other tests
    restore their tensors bit for bit."""
    monkeypatch.setattr(triton_codec._Launcher, "ready", lambda self, device, key: None)
    launches = []
    launch = triton_codec._Launcher.__call__

    def checked_launch(self, grid, device, key, args):
        launch(self, grid, device, key, args)
        if triton_codec._FAST_LAUNCH:
            expected = self._kernel.warmup(*args, grid=(grid,), **self.options)
            assert self._compiled[(device,) + key] is expected, key
        else:
            assert not self._compiled
        launches.append(key)

    monkeypatch.setattr(triton_codec._Launcher, "__call__", checked_launch)
    # The Gluon kernels where they run, and the portable ones they stand in for.
    modes = (True, False) if triton_codec._GLUON else (False,)
    for gluon in modes:
        monkeypatch.setattr(triton_codec, "_GLUON", gluon)
        g = cuda_generator("launch keys")
        storage = make_input(3 * 4096 + 40, torch.bfloat16, 0.5, g)
        buf = ValueBuffer(1 << 20, device="cuda")
        nonzeros = torch.zeros(1, dtype=torch.int64, device="cuda")
        # One tile and many, odd sizes, unaligned starts, and each optional output.
        for i, (offset, numel) in enumerate([(0, 1), (0, 4096), (1, 4097), (3, 3 * 4096 + 17), (8, 2 * 4096)]):
            x = storage[offset : offset + numel]
            for sign_pack in (False, True):
                report = torch.zeros(1, dtype=torch.int64, pin_memory=True) if i % 2 else None
                c = compress_with(
                    x, sign_pack=sign_pack, values=buf, nonzeros=nonzeros if i % 2 else None, report=report
                )
                assert_bitwise_equal(decompress(c), x)
        for dtype in GPU_DTYPES:
            x = make_input(5000, dtype, 0.5, g)
            assert_bitwise_equal(decompress(compress(x, sign_pack=True)), x)
        # Many programs (the portable encoder's persistent grid for sign packing runs two tiles each).
        x = make_input(
            2 * triton_codec._encode_programs(torch.cuda.current_device()) * 4096 + 5, torch.bfloat16, 0.5, g
        )
        assert_bitwise_equal(decompress(compress(x, sign_pack=True)), x)
        # A ReLU's square written, aligned and not (the portable encoder then), and measured.
        squares = torch.empty_like(storage)
        for offset, numel in ((0, 2 * 4096), (1, 4097)):
            x, square = storage[offset : offset + numel], squares[offset : offset + numel]
            c, _ = compress_relu_of(x, "triton", square=square)
            assert_bitwise_equal(decompress(c), x.masked_fill(x < 0, 0))
        counters = torch.zeros(3, dtype=torch.int64, device="cuda")
        triton_codec.measure(
            storage, counters[:1], counters[1:], dtype_spec(storage.dtype), TileGeometry(), False, relu_square=squares
        )
    assert len(launches) == len(modes) * (2 * (2 * 5 + len(GPU_DTYPES) + 1) + 2 * 2 + 1)


@pytest.mark.skipif(
    not triton_codec._FAST_LAUNCH or triton_codec._STATIC_LAUNCHER is None, reason="direct launches through Triton"
)
def test_direct_launches_go_through_pytorchs_static_launcher(monkeypatch):
    """Every kernel the codec compiles for tensors of more than one element is one PyTorch's
    static launcher launches (the direct launches of the other tests restore their tensors bit
    for bit), so none pays Triton's slower launch. (A one-element tensor's count is a
    constexpr among the arguments: Triton launches it.)"""
    launchers = [triton_codec._encode_launcher, triton_codec._decode_launcher, triton_codec._measure_launcher]
    launchers += [*triton_codec._gluon_encode_launchers.values(), *triton_codec._gluon_decode_launchers.values()]
    for launcher in launchers:  # this test's kernels only
        monkeypatch.setattr(launcher, "_compiled", {})
        monkeypatch.setattr(launcher, "_direct", {})
    g = cuda_generator("static launches")
    for dtype in GPU_DTYPES:
        for sign_pack in (False, True):
            x = make_input(3 * 4096 + 17, dtype, 0.5, g)
            assert_bitwise_equal(decompress(compress(x, sign_pack=sign_pack)), x)
    x = make_input(3 * 4096 + 17, torch.bfloat16, 0.5, g)
    value, square = decompress_with(compress(x), get_codec("triton", x.device), square=True)
    assert_bitwise_equal(value, x)
    assert_bitwise_equal(square, torch.square(x))
    compiled = [kernel for launcher in launchers for kernel in launcher._compiled.values()]
    assert len(compiled) >= 2 * len(GPU_DTYPES)
    assert [kernel for kernel in compiled if triton_codec._static_arg_types(kernel) is None] == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_decode_writes_the_square(dtype, sign_pack):
    """The compiled decoder's square is torch.square's on CUDA, for every bit pattern."""
    g = cuda_generator("square", dtype)
    x = random_bits(2**22 + 5, dtype, g)
    x.view(dtype_spec(dtype).bits_dtype)[torch.rand(x.numel(), generator=g, device="cuda") < 0.5] = 0
    c = compress(x, sign_pack=sign_pack, backend="triton")
    value, square = decompress_with(c, get_codec("triton", x.device), square=True)
    assert_bitwise_equal(value, x)
    assert_bitwise_equal(square, torch.square(x))


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
def test_relu_square_is_the_compiled_relu_square(dtype, sign_pack, monkeypatch):
    """``relu_square`` on CUDA, by the Gluon encoder, the portable one (also for a length the
    Gluon encoder does not take: it writes the square in whole words) and the measure: the
    square is what inductor's code computes for ``relu(x) ** 2`` for every bit pattern of the
    16-bit dtypes (a spread of float32's), and the ReLU stored is the reference codec's, in
    the same masks (what the CPU tests compare with inductor's code on the CPU)."""
    from bitsparse.hooks.exactness import probe

    calls = gluon_encodes(monkeypatch, dtype.itemsize * 8)
    x = probe(dtype, torch.device("cuda")).repeat(3)[: 3 * 65536 - 4]  # not a whole number of tiles
    odd = x[:-1]
    square_of_relu = torch.compile(lambda x: torch.relu(x) ** 2, dynamic=False)
    for case, portable in ((x, False), (x, True), (odd, True)):
        with monkeypatch.context() as m:
            if portable:
                m.setattr(triton_codec, "_GLUON", False)
            c, square = compress_relu_of(case, "triton", sign_pack)
        assert_bitwise_equal(square, square_of_relu(case))
        relu = below_zero_cleared(case.cpu())
        assert_bitwise_equal(decompress(c).cpu(), relu)
        reference, _ = compress_relu_of(case.cpu(), "torch", sign_pack)
        assert torch.equal(c.masks.cpu(), reference.masks) and c.nbytes == reference.nbytes
    assert len(calls) == (1 if triton_codec._GLUON else 0)
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    measured = torch.empty_like(x)
    spec = dtype_spec(dtype)
    triton_codec.measure(x, counters[:1], counters[1:], spec, TileGeometry(), sign_pack, relu_square=measured)
    assert_bitwise_equal(measured, square_of_relu(x))
    # Measured per tile into pinned host memory, as an arena without a buffer measures.
    tile_words = torch.full((TileGeometry().num_tiles(x.numel()),), -1, dtype=torch.int32, pin_memory=True)
    measured = torch.empty_like(x)
    triton_codec.measure_tiles(x, tile_words, spec, TileGeometry(), sign_pack, relu_square=measured)
    torch.cuda.synchronize()
    assert_bitwise_equal(measured, square_of_relu(x))
    reference, host = torch.empty_like(tile_words), x.cpu()
    torch_codec.measure_tiles(host, reference, spec, TileGeometry(), sign_pack, relu_square=torch.empty_like(host))
    assert torch.equal(tile_words, reference) and int(tile_words.sum()) == int(counters[0])


@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
def test_decode_writes_the_relu_square_backward(dtype, sign_pack, monkeypatch):
    """``decode`` with ``square_grad`` on CUDA, by the Gluon decoder and the portable one (also
    for a length that is not a whole number of tiles), and the Triton codec's
    ``relu_square_backward`` of the dense ReLU output and input: the bits of the torch
    codec's ``relu_square_backward`` on CUDA, NaNs included, for every bit pattern of the
    16-bit dtypes (a spread of float32's) in the ReLU output and random bits in the gradient."""
    from bitsparse.hooks.exactness import probe

    calls = gluon_launches(monkeypatch, triton_codec._gluon_decode_launchers, dtype.itemsize * 8)
    x = probe(dtype, torch.device("cuda")).repeat(3)[: 3 * 65536 - 4]
    r = below_zero_cleared(x)
    grad = random_bits(r.numel(), dtype, cuda_generator("relu_square_backward", dtype, sign_pack))
    for n, portable in ((r.numel(), False), (r.numel(), True), (r.numel() - 1, True)):
        expected = torch.empty_like(r[:n]), torch.empty_like(r[:n])
        torch_codec.relu_square_backward(r[:n], grad[:n], *expected)
        with monkeypatch.context() as m:
            if portable:
                m.setattr(triton_codec, "_GLUON", False)
            results = [decode_relu_square_backward(compress(r[:n], sign_pack=sign_pack), "triton", grad[:n])]
        for source, relu_input in ((r, False), (x, True)):
            results.append((torch.empty_like(r[:n]), torch.empty_like(r[:n])))
            triton_codec.relu_square_backward(source[:n], grad[:n], *results[-1], relu_input)
        for square, grad_input in results:
            assert_bitwise_equal(square, expected[0])
            assert_bitwise_equal(grad_input, expected[1])
    assert len(calls) == (1 if triton_codec._GLUON and (sign_pack or dtype != torch.float32) else 0)


def test_successive_appends_report_into_pinned_memory():
    check_successive_appends("triton", "cuda")


def test_too_small_buffer_never_corrupts_earlier_streams():
    g = cuda_generator("small")
    a = make_input(2**20 + 3, torch.bfloat16, 0.5, g)
    b = make_input(2**22, torch.float32, 0.2, g)
    a_words = int(compress(a, backend="triton").stream_words())
    buf = ValueBuffer(a_words + 100_000, device="cuda")
    ca = compress(a, values=buf, backend="triton")
    snapshot = buf.words[:a_words].clone()
    cb = compress(b, values=buf, backend="triton", sign_pack=True)
    assert ca.fits() and not cb.fits()
    assert torch.equal(buf.words[:a_words], snapshot)
    assert_bitwise_equal(decompress(ca, backend="triton"), a)


@pytest.mark.parametrize("shape", [(), (0,), (0, 7), (3, 5, 4097)], ids=str)
def test_small_shapes(shape):
    n = 1
    for d in shape:
        n *= d
    x = make_input(n, torch.float16, 0.5, cuda_generator("shape", shape)).reshape(shape)
    for sign_pack in (False, True):
        for enc in ("triton", "torch"):
            c = compress(x, sign_pack=sign_pack, backend=enc)
            for dec in ("triton", "torch"):
                assert_bitwise_equal(decompress(c, backend=dec), x)


def test_default_backend_on_cuda_is_triton():
    x = make_input(10_000, torch.bfloat16, 0.5, cuda_generator("default"))
    c = compress(x)
    # The torch encoder lays tiles out in order and zero-pads; check it is the triton layout
    # by decoding with both and comparing masks with the torch backend's.
    assert torch.equal(c.masks, compress(x, backend="torch").masks)
    assert_bitwise_equal(decompress(c), x)


def _strided_cases():
    base = make_input(6 * 4096 + 40, torch.bfloat16, 0.6, cuda_generator("strided"))
    m = base[: 96 * 256].view(96, 256)
    return {"transposed": m.t(), "step_slice_2d": m[::2, 1::3], "step_slice_1d": base[3::3], "column": m[:, 5]}


@pytest.mark.parametrize(
    "case",
    [
        "transposed",
        "step_slice_2d",
        "step_slice_1d",
        "column",
    ],
)
def test_non_contiguous_default_backend(case):
    x = _strided_cases()[case]
    assert not x.is_contiguous()
    assert_bitwise_equal(decompress(compress(x)), x.contiguous())


_SYNC_DEBUG_WARNING = "ignore:Synchronization debug mode is a prototype feature"


@pytest.mark.filterwarnings(_SYNC_DEBUG_WARNING)
def test_sync_debug_mode_detects_a_sync():
    """The check below can fail: an .item() in the checked region raises."""
    x = torch.ones(10, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.filterwarnings(_SYNC_DEBUG_WARNING)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("sign_pack", [False, True], ids=["raw", "signpack"])
def test_no_host_sync(backend, sign_pack):
    x = make_input(2**22 + 5, torch.bfloat16, 0.6, cuda_generator("sync"))
    buf = ValueBuffer(2**22, device="cuda")
    nonzeros = torch.zeros(1, dtype=torch.int64, device="cuda")
    # Warm up (compile the kernels, load the popcount table) outside the checked region.
    warm_counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    codec = get_codec(backend, x.device)
    decompress_with(compress_with(x, backend, sign_pack=sign_pack, nonzeros=warm_counter), codec)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        c = compress_with(x, backend, sign_pack=sign_pack, values=buf, nonzeros=nonzeros)
        y = decompress_with(c, codec)  # what the hooks call: public decompress checks the fit once
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.cuda.get_sync_debug_mode() == 0
    assert c.fits()
    assert int(nonzeros) == c.nnz()
    assert_bitwise_equal(y, x)
