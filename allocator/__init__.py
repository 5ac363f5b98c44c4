"""The arena allocator: one preallocated device buffer per device for compressed activations.

It knows nothing of autograd: it hands out words at host-known positions (``reserve_fixed``),
a device-side appendable region (``values``), asynchronous reports of how far appends went
(``submit``/``poll``), and leases whose release ends a step.
"""

from bitsparse.allocator.arena import Arena, ArenaUsage, Lease

__all__ = ["Arena", "ArenaUsage", "Lease"]
