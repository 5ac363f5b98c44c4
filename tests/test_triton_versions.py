"""Which Triton kernels run with which Triton, decided on the CPU.

The Gluon kernels run on CUDA only with the Triton release they were verified with
(``triton_codec.GLUON_TRITON``); with another one the portable kernels serve every call and
the first use on CUDA warns once, naming both releases. The CPU (the interpreter) never warns.
The decision is tested here with other version strings; the subprocess tests import the codec
as a CUDA machine would (without the interpreter), with ``triton.__version__`` replaced.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

pytest.importorskip("triton")

from bitsparse.codecs import triton_codec  # noqa: E402

VERIFIED = ".".join(map(str, triton_codec.GLUON_TRITON))


@pytest.mark.parametrize(
    "version, release",
    [
        ("3.6.0", (3, 6)),
        ("3.7.1", (3, 7)),
        ("3.10.0", (3, 10)),
        ("3.7.0+git1a2b3c4", (3, 7)),
        ("2.11.0+cu130", (2, 11)),
        ("unknown", (0, 0)),
    ],
)
def test_release(version, release):
    assert triton_codec.release(version) == release


@pytest.mark.parametrize("version", [VERIFIED + ".0", VERIFIED + ".1", VERIFIED + ".0+gitabcdef"])
def test_gluon_runs_on_the_verified_release(version):
    assert triton_codec.gluon_decision(version, interpreted=False, hip=None) == (True, None)


@pytest.mark.parametrize("version", ["3.5.1", "3.7.1", "3.8.0", "3.9.0", "4.0.0"])
def test_other_releases_run_the_portable_kernels_and_say_why(version):
    use, warning = triton_codec.gluon_decision(version, interpreted=False, hip=None)
    assert not use
    assert f"triton {version} is installed" in warning
    assert f"verified with triton {VERIFIED}" in warning
    assert "portable Triton kernels" in warning and "slower" in warning
    assert f"install triton {VERIFIED}" in warning


@pytest.mark.parametrize("version", [VERIFIED + ".0", "3.9.0"])
def test_interpreter_and_rocm_never_run_gluon_nor_warn(version):
    assert triton_codec.gluon_decision(version, interpreted=True, hip=None) == (False, None)
    assert triton_codec.gluon_decision(version, interpreted=False, hip="7.0") == (False, None)


def test_this_process_does_not_warn_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("the CPU path: without CUDA")
    assert triton_codec.INTERPRETED  # tests/conftest.py
    assert not triton_codec._GLUON and triton_codec._GLUON_WARNING is None


def test_warns_once_at_the_first_use_on_cuda(monkeypatch):
    monkeypatch.setattr(triton_codec, "INTERPRETED", False)
    monkeypatch.setattr(triton_codec, "_GLUON_WARNING", "bitsparse: test message")
    monkeypatch.setattr(triton_codec, "_warned", False)
    with pytest.warns(triton_codec.SlowKernelsWarning, match="test message") as record:
        triton_codec.check_device(torch.device("cuda"))
        triton_codec.check_device(torch.device("cuda", 1))
    assert len(record) == 1


def test_never_warns_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_codec, "INTERPRETED", True)
    monkeypatch.setattr(triton_codec, "_GLUON_WARNING", "bitsparse: test message")
    monkeypatch.setattr(triton_codec, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        triton_codec.check_device(torch.device("cpu"))
        triton_codec.check_device(torch.device("cuda"))


_IMPORT_AS_ON_CUDA = textwrap.dedent(
    """
    import sys, warnings
    import torch, triton
    installed = triton.__version__
    triton.__version__ = sys.argv[1]
    from bitsparse.codecs import triton_codec
    assert not triton_codec.INTERPRETED
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        triton_codec.check_device(torch.device("cuda"))
        triton_codec.check_device(torch.device("cuda"))
    print("gluon", triton_codec._GLUON, triton_codec.gluon_kernels is not None)
    print("fast_launch", triton_codec._FAST_LAUNCH)
    print("warnings", len(record))
    for w in record:
        assert w.category is triton_codec.SlowKernelsWarning, w
        print("message", w.message)
    """
)


def import_as_on_cuda(version: str) -> str:
    """The output of ``_IMPORT_AS_ON_CUDA``, run without the interpreter, Triton reporting ``version``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_AS_ON_CUDA, version], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="imports the codec without the interpreter on a CPU")
def test_verified_release_loads_gluon_and_does_not_warn():
    out = import_as_on_cuda(VERIFIED + ".0")
    assert "gluon True True" in out
    assert "fast_launch True" in out
    assert "warnings 0" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="imports the codec without the interpreter on a CPU")
def test_unverified_release_warns_once_and_does_not_load_gluon():
    out = import_as_on_cuda("3.99.0")
    assert "gluon False False" in out
    assert "fast_launch False" in out  # a launcher not read: Triton's own launch
    assert "warnings 1" in out
    assert "triton 3.99.0 is installed" in out and f"verified with triton {VERIFIED}" in out


class FakeCompiled:
    """What ``_static_arg_types`` reads of a compiled kernel: its signature and metadata."""

    def __init__(self, signature: dict, **metadata):
        self.src = type("Source", (), {"signature": signature})()
        defaults = {"num_warps": 4, "shared": 1024, "global_scratch_size": 0, "profile_scratch_size": 0}
        defaults.update(num_ctas=1, launch_pdl=False)
        self.metadata = type("Metadata", (), {**defaults, **metadata})()


ENCODER_SIGNATURE = {"x_ptr": "*bf16", "report_ptr": "*i64", "numel": "i32", "size": "i64", "TILE": "constexpr"}


@pytest.fixture
def static_launcher(monkeypatch):
    """A PyTorch build with the static launcher (CUDA's), whatever this one is."""
    monkeypatch.setattr(triton_codec, "_STATIC_LAUNCHER", object())
    monkeypatch.setattr(torch.version, "hip", None)


def test_static_launch_types_are_the_kernels_arguments_then_two_scratch_pointers(static_launcher):
    assert triton_codec._static_arg_types(FakeCompiled(ENCODER_SIGNATURE)) == "OOilOO"


@pytest.mark.parametrize(
    "signature, metadata",
    [
        (ENCODER_SIGNATURE, {"global_scratch_size": 64}),  # scratch memory Triton's launcher allocates
        (ENCODER_SIGNATURE, {"profile_scratch_size": 8}),
        (ENCODER_SIGNATURE, {"num_ctas": 2}),
        (ENCODER_SIGNATURE, {"launch_pdl": True}),
        (ENCODER_SIGNATURE, {"launch_cooperative_grid": True}),
        (ENCODER_SIGNATURE, {"tensordesc_meta": [{"block": 16}]}),
        ({"x_ptr": "*bf16", "ONE": "constexpr", "numel": "i32"}, {}),  # a constexpr among the arguments
        ({"x_ptr": "*bf16", "desc": "nvTmaDesc"}, {}),
    ],
)
def test_kernels_the_static_launcher_would_launch_otherwise_go_through_triton(static_launcher, signature, metadata):
    assert triton_codec._static_arg_types(FakeCompiled(signature, **metadata)) is None


@pytest.mark.parametrize("missing", ["profile_scratch_size", "shared", "signature"])
def test_a_compiled_kernel_that_does_not_say_enough_goes_through_triton(static_launcher, missing):
    """Another Triton's compiled kernel: without its scratch sizes the kernel's parameters are
    not known, without its shared memory or signature the launch cannot be built."""
    compiled = FakeCompiled(ENCODER_SIGNATURE)
    delattr(type(compiled.src if missing == "signature" else compiled.metadata), missing)
    assert triton_codec._static_arg_types(compiled) is None


def test_a_signature_with_nested_types_goes_through_triton(static_launcher):
    signature = {"x_ptr": "*bf16", "pair": ("*fp32", "i32")}  # a tuple argument
    assert triton_codec._static_arg_types(FakeCompiled(signature)) is None


def test_without_the_static_launcher_kernels_go_through_triton(monkeypatch):
    monkeypatch.setattr(triton_codec, "_STATIC_LAUNCHER", None)
    assert triton_codec._static_arg_types(FakeCompiled(ENCODER_SIGNATURE)) is None


_IMPORT_WITH_TORCH_VERSION = textwrap.dedent(
    """
    import sys
    import torch
    from torch.torch_version import TorchVersion
    torch.__version__ = TorchVersion(sys.argv[1])
    torch._C._StaticCudaLauncher = object()  # a CUDA build's launcher, on any build
    from bitsparse.codecs import triton_codec
    print("static", triton_codec._STATIC_LAUNCHER is torch._C._StaticCudaLauncher)
    """
)


@pytest.mark.parametrize(
    "version, static", [("2.10.0", False), ("2.11.0+cu130", True), ("2.14.1+cu130", True), ("2.15.0", False)]
)
def test_the_static_launcher_is_used_only_on_the_pytorch_releases_read(version, static):
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_WITH_TORCH_VERSION, version], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"static {static}" in result.stdout
