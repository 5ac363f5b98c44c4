"""pytest configuration for the BitSparse tests.

* Without CUDA, the Triton kernels can still run on CPU tensors in Triton's interpreter. It
  has to be switched on before ``bitsparse.codecs.triton_codec`` decorates its kernels, so it
  is done here, at conftest import time, before any test module is collected. An explicit
  ``TRITON_INTERPRET`` in the environment wins (``setdefault``).
* Shared helpers live in ``tests/helpers.py``; test modules do ``from helpers import ...``.
  ``tests/`` has no ``__init__.py``, so pytest's default "prepend" import mode already puts
  ``tests/`` on ``sys.path``; the insertion below makes that hold for
  ``--import-mode=importlib`` too. Run the suite from the repository root:
  ``python -m pytest``.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import helpers  # noqa: E402


@pytest.fixture
def assert_bitwise_equal():
    """``helpers.assert_bitwise_equal`` as a fixture, for tests that prefer fixtures."""
    return helpers.assert_bitwise_equal
