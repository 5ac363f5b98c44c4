"""Device memory followed by pinned host memory in one range of device addresses.

CUDA's virtual memory management (the driver's ``cuMemCreate``/``cuMemMap``, CUDA 12.2+ for
host memory) maps physical allocations into a reserved address range. Mapping device
memory and then host memory (on the host's NUMA node 0) back to back gives one buffer that
kernels index with one pointer: the words past the device part live in host memory, which
the GPU reads and writes over the bus. The arena puts its value region's tail there, so an
encoder whose values outrun the device part still has room, and the host need not wait to
learn whether they fit.

Such a buffer is not allocated by PyTorch's caching allocator: ``torch.cuda.memory_allocated``
does not count it.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

_DEVICE, _HOST_NUMA = 1, 3  # CUmemLocationType
_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProperties(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocationFlags),
    ]


class _AccessDescription(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _DriverError(RuntimeError):
    def __init__(self, call: str, code: int):
        super().__init__(f"CUDA driver call {call} failed with error {code}")
        self.code = code


@functools.cache
def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _call(name: str, *args) -> None:
    code = getattr(_driver(), name)(*args)
    if code != 0:
        raise _DriverError(name, code)


def _properties(location_type: int, location_id: int) -> _AllocationProperties:
    return _AllocationProperties(type=_PINNED, location=_Location(location_type, location_id))


@functools.cache
def granularity(device_index: int) -> int | None:
    """The bytes by which both parts of a buffer on CUDA device ``device_index`` are sized,
    or None where the driver cannot map host memory that way (no CUDA driver, or one older
    than 12.2)."""
    if _driver() is None or not hasattr(_driver(), "cuMemCreate"):
        return None
    sizes = []
    for location in (_Location(_DEVICE, device_index), _Location(_HOST_NUMA, 0)):
        size = ctypes.c_size_t()
        properties = _AllocationProperties(type=_PINNED, location=location)
        if _driver().cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(properties), 0) != 0:
            return None
        sizes.append(size.value)
    return max(sizes)


class _Mapping:
    """The reserved range and its two physical allocations; released with the last tensor
    over it. Exposes the range as ``__cuda_array_interface__`` for ``torch.as_tensor``."""

    def __init__(self, device: torch.device, device_bytes: int, host_bytes: int):
        self._device = device
        self._handles: list[ctypes.c_ulonglong] = []
        self._address = ctypes.c_ulonglong(0)
        self._mapped = 0
        self.size = device_bytes + host_bytes
        try:
            _call(
                "cuMemAddressReserve",
                ctypes.byref(self._address), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                ctypes.c_ulonglong(0), ctypes.c_ulonglong(0),
            )
            for offset, size, location in (
                (0, device_bytes, (_DEVICE, device.index)),
                (device_bytes, host_bytes, (_HOST_NUMA, 0)),
            ):
                handle = ctypes.c_ulonglong()
                _call(
                    "cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size),
                    ctypes.byref(_properties(*location)), ctypes.c_ulonglong(0),
                )
                self._handles.append(handle)
                _call(
                    "cuMemMap", ctypes.c_ulonglong(self._address.value + offset), ctypes.c_size_t(size),
                    ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0),
                )
                self._mapped += size
            access = _AccessDescription(_Location(_DEVICE, device.index), _READ_WRITE)
            _call(
                "cuMemSetAccess", ctypes.c_ulonglong(self._address.value), ctypes.c_size_t(self.size),
                ctypes.byref(access), ctypes.c_size_t(1),
            )
        except BaseException:
            self._release()
            raise
        self.__cuda_array_interface__ = {
            "shape": (self.size // 4,), "typestr": "<i4", "data": (self._address.value, False),
            "version": 3, "strides": None,
        }

    def _release(self) -> None:
        if sys.is_finalizing():  # the driver frees everything at exit, and may be gone already
            return
        # The driver calls act on the current context, and the last tensor over the range may
        # die in a thread that has none (autograd's).
        with torch.cuda.device(self._device):
            try:
                if self._mapped:
                    # Kernels queued on any stream may still use the range: unmapping under them
                    # is undefined, so the release waits for the device (buffers are released
                    # rarely, between steps).
                    torch.cuda.synchronize(self._device)
            finally:
                if self._mapped:
                    _driver().cuMemUnmap(ctypes.c_ulonglong(self._address.value), ctypes.c_size_t(self._mapped))
                    self._mapped = 0
                for handle in self._handles:
                    _driver().cuMemRelease(handle)
                self._handles = []
                if self._address.value:
                    _driver().cuMemAddressFree(ctypes.c_ulonglong(self._address.value), ctypes.c_size_t(self.size))
                    self._address = ctypes.c_ulonglong(0)

    def __del__(self):
        self._release()


def device_then_host(device: torch.device, device_bytes: int, host_bytes: int) -> torch.Tensor:
    """An int32 tensor on CUDA ``device`` whose first ``device_bytes`` are device memory and
    whose last ``host_bytes`` are pinned host memory; both multiples of ``granularity``.

    Raises:
        ValueError: sizes that are not multiples of the granularity, or a driver that cannot
            map host memory (``granularity`` is None).
        torch.OutOfMemoryError: the device or the host has no room, even after PyTorch's
            caching allocator returned its free blocks.
    """
    step = granularity(device.index)
    if step is None or device_bytes % step or host_bytes % step or not device_bytes or not host_bytes:
        raise ValueError(
            f"device_bytes ({device_bytes}) and host_bytes ({host_bytes}) must be positive multiples of the "
            f"mapping granularity ({step}; None: this driver cannot map host memory)"
        )
    with torch.cuda.device(device):  # the driver calls act on the current context
        for attempt in range(2):
            try:
                mapping = _Mapping(device, device_bytes, host_bytes)
                break
            except _DriverError as error:
                if error.code != _OUT_OF_MEMORY:
                    raise
                if attempt:
                    raise torch.OutOfMemoryError(
                        f"no room for an arena of {device_bytes} device bytes and {host_bytes} host bytes on "
                        f"{device}"
                    ) from error
                torch.cuda.empty_cache()
        return torch.as_tensor(mapping, device=device)
