"""BitSparse: lossless compression of the sparse activations autograd saves for backward.

Codec API::

    c = bitsparse.compress(x)          # a CompressedTensor: bitmask + packed nonzero values
    y = bitsparse.decompress(c)        # equal to x bit for bit

The storage format is specified in ``docs/format.md`` and implemented in ``bitsparse.format``.
"""

from bitsparse.compressed import CompressedTensor, ValueBuffer, compress, decompress
from bitsparse.format import SUPPORTED_DTYPES, TileGeometry

__version__ = "0.1.0"

__all__ = [
    "CompressedTensor",
    "SUPPORTED_DTYPES",
    "TileGeometry",
    "ValueBuffer",
    "compress",
    "decompress",
]
