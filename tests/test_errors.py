"""Clear errors for wrong inputs to compress, decompress and ValueBuffer."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from bitsparse import ValueBuffer, compress, decompress
from bitsparse.codecs import get_codec

SUPPORTED = r"float32, float16, bfloat16, float8_e4m3fn, float8_e5m2"


@pytest.mark.parametrize(
    "x, type_name",
    [
        ([1.0, 2.0], "list"),
        (3.0, "float"),
        (None, "NoneType"),
        (torch.ones(3).numpy(), "ndarray"),
    ],
    ids=["list", "float", "None", "ndarray"],
)
def test_compress_non_tensor(x, type_name):
    with pytest.raises(TypeError, match=f"compress expects a torch.Tensor, got {type_name}"):
        compress(x)


@pytest.mark.parametrize(
    "dtype",
    [torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool,
     torch.float64, torch.complex64, torch.complex128],
    ids=str,
)
@pytest.mark.parametrize("backend", [None, "torch", "triton"])
def test_compress_unsupported_dtype(dtype, backend):
    x = torch.zeros(10, dtype=dtype)
    with pytest.raises(TypeError, match=f"bitsparse stores {SUPPORTED}; got a tensor of dtype {dtype}"):
        compress(x, backend=backend)


def test_compress_sparse_coo():
    x = torch.eye(4).to_sparse()
    assert x.layout == torch.sparse_coo
    with pytest.raises(ValueError, match="dense \\(strided\\) tensor, got layout torch.sparse_coo"):
        compress(x)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_compress_sparse_csr():
    x = torch.eye(4).to_sparse_csr()
    with pytest.raises(ValueError, match="dense \\(strided\\) tensor, got layout torch.sparse_csr"):
        compress(x)


@pytest.mark.parametrize("backend", ["cuda", "Torch", "", "numpy"])
def test_unknown_backend(backend):
    with pytest.raises(ValueError, match=rf"unknown backend {backend!r}: choose one of \('torch', 'triton'\) or None"):
        compress(torch.ones(4), backend=backend)
    c = compress(torch.ones(4))
    with pytest.raises(ValueError, match=rf"unknown backend {backend!r}"):
        decompress(c, backend=backend)
    with pytest.raises(ValueError, match="choose one of"):
        get_codec(backend, torch.device("cpu"))


_NOT_INTERPRETED = textwrap.dedent(
    """
    import torch
    from bitsparse import compress, decompress
    from bitsparse.codecs import triton_codec
    assert not triton_codec.INTERPRETED
    x = torch.ones(10)
    for call in (lambda: compress(x, backend="triton"),
                 lambda: decompress(compress(x), backend="triton")):
        try:
            call()
        except ValueError as e:
            msg = str(e)
            assert "TRITON_INTERPRET" in msg and "backend='torch'" in msg and "cpu" in msg, msg
        else:
            raise SystemExit("no ValueError")
    # The default backend on the CPU is torch, which works.
    assert torch.equal(decompress(compress(x)), x)
    # The training API refuses the backend when it is given, before any forward runs.
    import bitsparse
    for make in (lambda: bitsparse.compressing(backend="triton"), lambda: bitsparse.enable(backend="triton")):
        try:
            make()
        except ValueError as e:
            assert "TRITON_INTERPRET" in str(e), str(e)
        else:
            raise SystemExit("compressing(backend='triton') accepted without CUDA")
    assert not bitsparse.is_enabled()
    print("OK")
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("interpret", [None, "0"], ids=["unset", "zero"])
def test_triton_on_cpu_without_interpreter(interpret):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, "-c", _NOT_INTERPRETED], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK")


def test_value_buffer_on_another_device():
    buf = ValueBuffer(100, device="meta")
    assert buf.device == torch.device("meta")
    with pytest.raises(ValueError, match="values buffer is on meta but the tensor is on cpu"):
        compress(torch.ones(10), values=buf)
    with pytest.raises(ValueError, match="values buffer is on meta"):
        compress(torch.ones(10), values=buf, backend="torch")


@pytest.mark.parametrize("obj", [torch.ones(3), None, "c", object()], ids=["tensor", "None", "str", "object"])
def test_decompress_non_compressed(obj):
    with pytest.raises(TypeError, match=f"decompress expects a CompressedTensor, got {type(obj).__name__}"):
        decompress(obj)


@pytest.mark.parametrize("capacity", [-1, -100])
def test_value_buffer_negative_capacity(capacity):
    with pytest.raises(ValueError, match=f"capacity_words must be >= 0, got {capacity}"):
        ValueBuffer(capacity)


def test_errors_leave_buffer_untouched():
    buf = ValueBuffer(10)
    with pytest.raises(TypeError):
        compress(torch.ones(4, dtype=torch.float64), values=buf)
    with pytest.raises(ValueError):
        compress(torch.ones(4), values=buf, backend="nope")
    assert int(buf.cursor) == 0


@pytest.mark.parametrize(
    "words, counters",
    [
        (torch.zeros(0, dtype=torch.int32), torch.zeros(3, dtype=torch.int64)),
        (torch.zeros(10, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)),
        (torch.zeros(2, 5, dtype=torch.int32), torch.zeros(3, dtype=torch.int64)),
        (torch.zeros(10, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)),
        (torch.zeros(10, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)),
        (torch.zeros(10, dtype=torch.int32), torch.zeros(3, dtype=torch.int64, device="meta")),
    ],
    ids=["empty", "int64-words", "2d-words", "int32-counters", "counters-shape", "counters-device"],
)
def test_value_buffer_over_rejects(words, counters):
    with pytest.raises(ValueError, match="words must be|counters must be"):
        ValueBuffer.over(words, counters)


@pytest.mark.parametrize("capacity", [10.5, "100", None, True], ids=["float", "str", "None", "bool"])
def test_value_buffer_capacity_of_the_wrong_type(capacity):
    with pytest.raises(TypeError, match="capacity_words must be an int"):
        ValueBuffer(capacity)


@pytest.mark.parametrize("values", [torch.zeros(10, dtype=torch.int32), 100, "buf"], ids=["tensor", "int", "str"])
def test_compress_values_of_the_wrong_type(values):
    with pytest.raises(TypeError, match="values must be a bitsparse.ValueBuffer"):
        compress(torch.ones(10), values=values)
