"""CUDA VMM back-end over ``cuda.bindings.driver`` (cuda-python, imported lazily).

Every driver call returns a tuple ``(err, *values)``; each is checked and turned into ``VMMError``. The calls run in
the device's primary context (the one torch uses), made current on every thread that calls in, so the restore
worker thread can remap ranges too.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from elastiserve.memory.errors import BackendUnavailable, VMMError
from elastiserve.memory.vmm.base import check_aligned, cuda_device_index, device_tensor_view


def _import_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailable("the CUDA VMM back-end needs cuda-python (pip install cuda-bindings)") from exc
    return driver


class CudaBackend:
    """``VMMBackend`` over cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess."""

    name = "cuda"

    def __init__(self, device: torch.device | int | None = None, *, driver: Any = None) -> None:
        if not torch.cuda.is_available() or torch.version.hip is not None:
            raise BackendUnavailable("the CUDA VMM back-end needs an NVIDIA GPU visible to torch")
        self._cu = driver if driver is not None else _import_driver()
        index = cuda_device_index(device)
        self._device = torch.device("cuda", index)
        torch.empty(1, device=self._device)  # make torch initialise CUDA (and its primary context) first
        self._thread_state = threading.local()
        self._call("cuInit", self._cu.cuInit(0))
        (self._cu_device,) = self._call("cuDeviceGet", self._cu.cuDeviceGet(index))
        (self._context,) = self._call("cuDevicePrimaryCtxRetain", self._cu.cuDevicePrimaryCtxRetain(self._cu_device))
        self._ensure_context()
        self._prop = self._allocation_prop(index)
        flag = self._cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        (granularity,) = self._call("cuMemGetAllocationGranularity", self._cu.cuMemGetAllocationGranularity(
            self._prop, flag))
        self._granularity = int(granularity)
        self._access = self._access_desc(index)

    @property
    def device(self) -> torch.device:
        return self._device

    def _call(self, what: str, result: Any) -> tuple:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise VMMError(f"{what} failed: {err!r}")
        return tuple(values)

    def _ensure_context(self) -> None:
        if getattr(self._thread_state, "ready", False):
            return
        self._call("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(self._context))
        self._thread_state.ready = True

    def _allocation_prop(self, index: int) -> Any:
        prop = self._cu.CUmemAllocationProp()
        prop.type = self._cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = self._cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        return prop

    def _access_desc(self, index: int) -> Any:
        desc = self._cu.CUmemAccessDesc()
        desc.location.type = self._cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = self._cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def granularity(self) -> int:
        return self._granularity

    def reserve(self, size: int) -> int:
        check_aligned("reserve size", size, self._granularity)
        self._ensure_context()
        (va,) = self._call("cuMemAddressReserve", self._cu.cuMemAddressReserve(size, self._granularity, 0, 0))
        return int(va)

    def free_reservation(self, va: int, size: int) -> None:
        self._ensure_context()
        self._call("cuMemAddressFree", self._cu.cuMemAddressFree(va, size))

    def create(self, size: int) -> Any:
        check_aligned("create size", size, self._granularity)
        self._ensure_context()
        (handle,) = self._call("cuMemCreate", self._cu.cuMemCreate(size, self._prop, 0))
        return handle

    def release(self, handle: Any) -> None:
        self._ensure_context()
        self._call("cuMemRelease", self._cu.cuMemRelease(handle))

    def map(self, va: int, size: int, handle: Any) -> None:
        check_aligned("map va", va, self._granularity)
        check_aligned("map size", size, self._granularity)
        self._ensure_context()
        self._call("cuMemMap", self._cu.cuMemMap(va, size, 0, handle, 0))

    def unmap(self, va: int, size: int) -> None:
        self._ensure_context()
        self._call("cuMemUnmap", self._cu.cuMemUnmap(va, size))

    def set_access(self, va: int, size: int) -> None:
        self._ensure_context()
        self._call("cuMemSetAccess", self._cu.cuMemSetAccess(va, size, [self._access], 1))

    def tensor_view(self, va: int, nbytes: int) -> torch.Tensor:
        return device_tensor_view(va, nbytes, self._device)
