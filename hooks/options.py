"""The options of ``bitsparse.compressing()`` and ``bitsparse.enable()``, checked when given."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitsparse.codecs import BACKENDS, get_codec

SELECTIONS = ("relu", "all")
MIN_CAPACITY_BYTES = 4096
"""The smallest explicit arena: room for the masks of a few tiles."""
DEFAULT_MIN_NUMEL = 1 << 16


@dataclass(frozen=True)
class Options:
    """How saved tensors are stored; the keyword arguments of ``compressing``/``enable``.

    Attributes:
        capacity: the arena's size per device when it is made or when this value changes:
            "auto" (nothing at first: the first step measures what it would store, in host
            memory, and keeps it dense, so it peaks no higher than without BitSparse), a
            number of bytes (an int >= 4096), or a fraction of the device's free memory (a
            float in (0, 1]; available RAM on the CPU). Either way the arena then follows
            demand between steps: it is resized to what the last step needed plus 15% when
            that came close to its size or used less than half of it. Tensors that do not
            fit are kept dense (exactly).
        sign_pack: drop the sign bit of ReLU-family values (never lossy: see ``compress``).
        min_numel: tensors with fewer elements are kept as they are.
        select: "relu" compresses tensors that ReLU-family ops produced (and their squares),
            read from ``grad_fn``, and tries those whose op autograd hides (in-place ops on
            views, threshold); "all" tries every floating tensor. Either way a save site
            (producer, shape, dtype) whose tensors shrink by less than 20% is kept dense from
            then on.
        backend: codec backend, as for ``compress`` (None: Triton on CUDA, torch elsewhere).
        window: most compressed tensors that the arena is not sure of room for and whose fit
            the host has not confirmed yet (None: no count). Each one keeps its dense tensor
            until confirmed; beyond the first, only while these dense tensors take less than
            the step saves (the dense size of what it stores less the arena's), so no step
            peaks above dense. The default of 1 saves the most where the host runs far ahead
            of the GPU; a wider window (None) keeps the lead a host gains in bursts, at the
            cost of the memory held at the step's peak where the host is far ahead there.
            With ``host_spill``, the arena is sure of room for a step like the last one, so
            the window only applies to a first step with an explicit capacity and to steps
            that store more tensors than the last.
        recompute_squares: restore ``relu(x) ** 2`` from the stored ``relu(x)``, with the op
            the forward used, rather than storing it too; likewise a product whose node saved
            both factors, one of them stored (a ReGLU's ``relu(g) * u``), with ``torch.mul``.
            In compiled graphs the partitioner is steered to recompute such squares, whatever
            this says.
        host_spill: on CUDA, continue the arena's value region in pinned host memory (up to
            a quarter of the host's available memory, divided among its GPUs), sized from
            the second step on for the most the last step's tensors could take beyond the
            device part. The arena is then sure of room for a step like the last: no tensor
            is held dense or waited for, and values that outrun the device part (a step
            less sparse than the last) go to host memory and are read back in backward. Such an
            arena is mapped through CUDA's virtual memory API, outside PyTorch's caching
            allocator (``torch.cuda.memory_allocated`` leaves it out; ``stats().arena_reserved``
            has it). Ignored off CUDA and where the driver cannot map host memory (before
            CUDA 12.2), and from the first step that begins while an earlier step's tensors
            are alive (a pipeline schedule), whose arenas are resized and released as steps
            come and go, which a mapped arena would synchronize for; where mapping fails (no
            room), the arena goes on without it and warns.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: an option out of range, or a backend that cannot run here.
    """

    capacity: int | float | str = "auto"
    sign_pack: bool = False
    min_numel: int = DEFAULT_MIN_NUMEL
    select: str = "relu"
    backend: str | None = None
    window: int | None = 1
    recompute_squares: bool = True
    host_spill: bool = True

    def __post_init__(self):
        c = self.capacity
        if not (
            c == "auto"
            or (_is_int(c) and c >= MIN_CAPACITY_BYTES)
            or (isinstance(c, float) and 0 < c <= 1)
        ):
            raise ValueError(
                f"capacity must be 'auto', a number of bytes (an int >= {MIN_CAPACITY_BYTES}) or a fraction of "
                f"free memory (a float in (0, 1]); got {c!r}"
            )
        for name in ("sign_pack", "recompute_squares", "host_spill"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _is_int(self.min_numel) or self.min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {self.min_numel!r}")
        if self.select not in SELECTIONS:
            raise ValueError(f"select must be one of {SELECTIONS}, got {self.select!r}")
        if self.window is not None and (not _is_int(self.window) or self.window < 1):
            raise ValueError(f"window must be None or an int >= 1, got {self.window!r}")
        if self.backend is not None:
            if self.backend not in BACKENDS:
                raise ValueError(f"backend must be None, 'torch' or 'triton', got {self.backend!r}")
            # A backend that cannot run here fails now, not in the middle of a forward pass.
            get_codec(self.backend, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
