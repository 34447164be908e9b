"""Host back-end specifics: the dual mapping is real page aliasing (both addresses are MAP_SHARED views of the same
memfd in /proc/self/maps), unmap leaves a PROT_NONE reservation, and libc failures become VMMError."""

from __future__ import annotations

import pytest
import torch

from elastiserve.memory.errors import BackendUnavailable, VMMError
from elastiserve.memory.virtual_tensor import VirtualRange
from elastiserve.memory.vmm import open_backend
from elastiserve.memory.vmm.host import MEMFD_NAME, HostBackend

pytestmark = [pytest.mark.cpu]


def _maps_line(va: int) -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= va < end:
                return line
    raise AssertionError(f"{va:#x} is not in /proc/self/maps")


def test_both_addresses_map_the_same_memfd():
    backend = HostBackend()
    page = backend.granularity()
    handle = backend.create(page)
    with VirtualRange(backend, 3 * page) as first, VirtualRange(backend, page) as second:
        first.map_unit(1, handle)
        second.map_unit(0, handle)
        one, two = _maps_line(first.unit_va(1)), _maps_line(second.va)
        assert MEMFD_NAME in one and MEMFD_NAME in two
        assert one.split()[1].startswith("rw-s") and two.split()[1].startswith("rw-s")
        assert one.split()[4] == two.split()[4]  # same inode
        assert _maps_line(first.va).split()[1] == "---p"  # unmapped slots stay reserved, inaccessible
        first.view(torch.int32, (page // 4,), offset=page)[:] = 41
        assert torch.all(second.view(torch.int32) == 41)
        first.unmap_unit(1)
        assert _maps_line(first.unit_va(1)).split()[1] == "---p"
    backend.release(handle)


def test_libc_failures_raise_vmm_error():
    backend = HostBackend()
    page = backend.granularity()
    with pytest.raises(VMMError, match="errno"):
        backend.reserve(1 << 62)  # more address space than exists
    handle = backend.create(page)
    backend.release(handle)
    with VirtualRange(backend, page) as rng, pytest.raises(VMMError, match="errno"):
        rng.map_unit(0, handle)  # its fd is closed


def test_cuda_backend_unavailable_without_an_nvidia_gpu():
    with pytest.raises(BackendUnavailable):
        open_backend("cuda")
    assert isinstance(open_backend("auto"), HostBackend)
