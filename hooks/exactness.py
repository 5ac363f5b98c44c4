"""Checks that a fast path gives the bits PyTorch's own op gives, made once and remembered.

The decoder can write the square of what it restores in the same pass (backward needs a
ReLU's output and its square). That square is only used where it was checked equal, bit for
bit, to the op the forward used, on a probe of the dtype's bit patterns: every pattern for
16-bit dtypes, and for float32 every sign and exponent with a spread of mantissas (NaN
payloads, subnormals, rounding cases). The check synchronizes once per codec, op, dtype and
device type; ``clear`` forgets the results.
"""

from __future__ import annotations

import torch

from bitsparse.codecs import SQUARE_DTYPES, Codec
from bitsparse.compressed import compress, decompress_with
from bitsparse.hooks.provenance import Square

_FLOAT32_MANTISSAS = (0, 1, 2, 3, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE, 0x7FFFFF)


def probe(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Bit patterns of ``dtype`` on which a square is checked (65536 of them)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).to(device)
    if dtype != torch.float32:
        raise ValueError(f"no probe for {dtype}")
    sign_and_exponent = torch.arange(512, dtype=torch.int64) << 23
    generator = torch.Generator().manual_seed(0)
    random = torch.randint(0, 1 << 23, (128 - len(_FLOAT32_MANTISSAS),), generator=generator)
    mantissas = torch.cat([torch.tensor(_FLOAT32_MANTISSAS, dtype=torch.int64), random])
    patterns = (sign_and_exponent[:, None] | mantissas[None, :]).flatten()
    return torch.where(patterns >= 1 << 31, patterns - (1 << 32), patterns).to(torch.int32).view(dtype).to(device)


class ExactnessChecks:
    """The results of the checks made so far, by what they checked."""

    def __init__(self):
        self._results: dict[tuple, bool] = {}

    def fused_square(self, codec: Codec, dtype: torch.dtype, device: torch.device, square: Square) -> bool:
        """Whether ``codec``'s decoder writes, for every probed pattern of ``dtype`` on
        ``device``'s type, exactly the bits of ``square`` (the forward's op)."""
        key = ("fused_square", codec.name, dtype, device.type, square)
        result = self._results.get(key)
        if result is None:
            result = dtype in SQUARE_DTYPES and _same_bits(codec, probe(dtype, device), square)
            self._results[key] = result
        return result

    def clear(self) -> None:
        self._results.clear()


def _same_bits(codec: Codec, x: torch.Tensor, square: Square) -> bool:
    restored, fused = decompress_with(compress(x, backend=codec.name), codec, square=True)
    bits = torch.int16 if x.element_size() == 2 else torch.int32
    return torch.equal(restored.view(bits), x.view(bits)) and torch.equal(fused.view(bits), square(x).view(bits))
