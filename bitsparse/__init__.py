"""BitSparse: lossless compression of the sparse activations autograd saves for backward.

Codec API::

    c = bitsparse.compress(x)          # a CompressedTensor: bitmask + packed nonzero values
    y = bitsparse.decompress(c)        # equal to x bit for bit

Training API::

    with bitsparse.compressing():      # ReLU-family activations saved for backward are compressed
        loss = model(batch)
    loss.backward()                    # and restored bit for bit
    print(bitsparse.stats())

The storage format is specified in ``docs/format.md`` and implemented in ``bitsparse.format``;
``docs/design.md`` explains how the pieces fit.
"""

from bitsparse.compressed import CompressedTensor, ValueBuffer, compress, decompress
from bitsparse.format import SUPPORTED_DTYPES, TileGeometry
from bitsparse.hooks.options import Options
from bitsparse.hooks.stats import Stats
from bitsparse.training import compressing, disable, enable, is_enabled, mark, reset, stats

__version__ = "0.1.0"

__all__ = [
    "CompressedTensor",
    "Options",
    "SUPPORTED_DTYPES",
    "Stats",
    "TileGeometry",
    "ValueBuffer",
    "compress",
    "compressing",
    "decompress",
    "disable",
    "enable",
    "is_enabled",
    "mark",
    "reset",
    "stats",
]
