"""Host VMM back-end: real page aliasing on Linux, the CPU engine's memory and the CI stand-in for the GPU.

A physical handle is a memfd of ``size`` bytes; mapping it with ``MAP_SHARED | MAP_FIXED`` at two addresses
gives two views of the same pages, exactly the dual mapping the GPU back-ends make with ``cuMemMap``.
Python's ``mmap`` module cannot place a mapping at a chosen address, so the calls go through libc via ctypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass

import torch

from elastiserve.memory.errors import BackendUnavailable, VMMError
from elastiserve.memory.vmm.base import check_aligned

# Linux values (identical on x86-64 and aarch64).
PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
MEMFD_NAME = "elastiserve-unit"


@dataclass(frozen=True, slots=True)
class HostHandle:
    fd: int
    size: int


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


class HostBackend:
    """``VMMBackend`` over anonymous reservations and memfd-backed pages (Linux only)."""

    name = "host"

    def __init__(self) -> None:
        if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
            raise BackendUnavailable("the host VMM back-end needs Linux (memfd_create, mmap MAP_FIXED)")
        self._libc = _load_libc()
        self._page = os.sysconf("SC_PAGE_SIZE")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def granularity(self) -> int:
        return self._page

    def _mmap(self, call: str, va: int | None, size: int, prot: int, flags: int, fd: int) -> int:
        ctypes.set_errno(0)
        result = self._libc.mmap(va, size, prot, flags, fd, 0)
        if result is None or result == MAP_FAILED:
            err = ctypes.get_errno()
            raise VMMError(f"{call}: mmap(va={va or 0:#x}, size={size:#x}) failed: errno {err} ({os.strerror(err)})")
        if va is not None and result != va:
            raise VMMError(f"{call}: mmap placed the range at {result:#x} instead of {va:#x}")
        return result

    def reserve(self, size: int) -> int:
        check_aligned("reserve size", size, self._page)
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
        return self._mmap("reserve", None, size, PROT_NONE, flags, -1)

    def free_reservation(self, va: int, size: int) -> None:
        check_aligned("free_reservation va", va, self._page)
        check_aligned("free_reservation size", size, self._page)
        if self._libc.munmap(va, size) != 0:
            err = ctypes.get_errno()
            raise VMMError(f"free_reservation: munmap({va:#x}, {size:#x}) failed: errno {err} ({os.strerror(err)})")

    def create(self, size: int) -> HostHandle:
        check_aligned("create size", size, self._page)
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        except OSError as exc:
            raise VMMError(f"create: memfd_create failed: {exc}") from exc
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            os.close(fd)
            raise VMMError(f"create: ftruncate({size:#x}) failed: {exc}") from exc
        return HostHandle(fd, size)

    def release(self, handle: HostHandle) -> None:
        # Pages stay alive while mapped anywhere; the kernel frees them at the last unmap.
        try:
            os.close(handle.fd)
        except OSError as exc:
            raise VMMError(f"release: close(fd={handle.fd}) failed: {exc}") from exc

    def map(self, va: int, size: int, handle: HostHandle) -> None:
        check_aligned("map va", va, self._page)
        check_aligned("map size", size, self._page)
        if size > handle.size:
            raise VMMError(f"map: size {size:#x} exceeds the handle's {handle.size:#x}")
        self._mmap("map", va, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, handle.fd)

    def unmap(self, va: int, size: int) -> None:
        # Re-mapping PROT_NONE anonymous memory over the range drops the pages but keeps the address reserved.
        check_aligned("unmap va", va, self._page)
        check_aligned("unmap size", size, self._page)
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
        self._mmap("unmap", va, size, PROT_NONE, flags, -1)

    def set_access(self, va: int, size: int) -> None:
        """Nothing to do: ``map`` already maps read-write (kept for the facade)."""
        check_aligned("set_access va", va, self._page)
        check_aligned("set_access size", size, self._page)

    def tensor_view(self, va: int, nbytes: int) -> torch.Tensor:
        buffer = (ctypes.c_uint8 * nbytes).from_address(va)
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
