"""The arena allocator: preallocated device buffers for compressed activations, one per device
and step whose tensors are alive.

It knows nothing of autograd: it hands out words at host-known positions (``reserve_fixed``),
a device-side appendable region (``values``), asynchronous reports of how far appends went
(``submit``/``poll``), and leases whose release lets a buffer serve another step; a pool
(``ArenaPool``) gives overlapping steps buffers of their own.
"""

from bitsparse.allocator.arena import Arena, ArenaUsage, Lease
from bitsparse.allocator.pool import ArenaPool

__all__ = ["Arena", "ArenaPool", "ArenaUsage", "Lease"]
