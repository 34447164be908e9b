"""VMM facade and virtual tensors: one physical handle mapped at two addresses aliases (bit-identical through both
views), unmapping keeps the reservation, misuse raises typed errors, and explicit back-ends a machine lacks raise."""

from __future__ import annotations

import pytest
import torch

from elastiserve.memory.errors import BackendUnavailable, VMMError
from elastiserve.memory.virtual_tensor import VirtualRange
from elastiserve.memory.vmm import VMMBackend, open_backend

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def test_backend_satisfies_protocol(backend):
    assert isinstance(backend, VMMBackend)
    assert backend.granularity() > 0 and backend.granularity() & (backend.granularity() - 1) == 0


def test_two_mappings_alias_bit_identically(backend, device):
    unit = backend.granularity()
    handle = backend.create(2 * unit)
    first, second = VirtualRange(backend, 2 * unit, unit_bytes=2 * unit), VirtualRange(backend, 2 * unit,
                                                                                      unit_bytes=2 * unit)
    try:
        first.map_unit(0, handle)
        second.map_unit(0, handle)
        assert first.va != second.va
        writer = first.view(torch.float16, (unit // 2, 2))
        reader = second.view(torch.float16, (unit // 2, 2))
        assert writer.device.type == device.type and writer.data_ptr() == first.va
        pattern = torch.randint(0, 1 << 16, (unit,), dtype=torch.int32, generator=torch.Generator().manual_seed(7))
        writer.view(torch.int16).copy_(pattern.to(torch.int16).view(unit // 2, 2).to(device))
        assert torch.equal(reader.view(torch.int16), writer.view(torch.int16))
        assert torch.equal(reader.view(torch.int16).cpu().reshape(-1), pattern.to(torch.int16))
        reader.view(torch.uint8)[0, 0] = 0xAB  # and back the other way
        assert int(writer.view(torch.uint8)[0, 0]) == 0xAB
    finally:
        first.close()
        second.close()
        backend.release(handle)


def test_remap_keeps_reservation_and_switches_pages(backend):
    unit = backend.granularity()
    a, b = backend.create(unit), backend.create(unit)
    rng = VirtualRange(backend, unit)
    try:
        rng.map_unit(0, a)
        rng.view()[:] = 1
        rng.unmap_unit(0)
        rng.unmap_unit(0)  # idempotent: a retried restore unmaps a slot a failed one already dropped
        rng.map_unit(0, b)
        assert int(rng.view().sum()) == 0  # fresh pages of b, same address
        rng.unmap_unit(0)
        rng.map_unit(0, a)
        assert int(rng.view().sum()) == unit  # a kept its bytes while unmapped
    finally:
        rng.close()
        backend.release(a)
        backend.release(b)


def test_misuse_raises_vmm_error(backend):
    unit = backend.granularity()
    with pytest.raises(VMMError, match="granularity"):
        backend.reserve(unit + 1)
    handle = backend.create(unit)
    rng = VirtualRange(backend, 2 * unit)
    try:
        rng.map_unit(1, handle)
        with pytest.raises(VMMError, match="already mapped"):
            rng.map_unit(1, handle)
        with pytest.raises(VMMError, match="outside"):
            rng.map_unit(2, handle)
        with pytest.raises(VMMError, match="does not fit"):
            rng.view(torch.float32, (unit,))
    finally:
        rng.close()
        backend.release(handle)


@pytest.mark.parametrize("name", ["hip", "nope"])
def test_explicit_backend_the_machine_lacks_raises(name, device):
    with pytest.raises(BackendUnavailable):
        open_backend(name, device)



def test_unmap_units_drops_a_run_and_keeps_the_rest(backend):
    unit = backend.granularity()
    handles = [backend.create(unit) for _ in range(3)]
    rng = VirtualRange(backend, 3 * unit)
    try:
        for index, handle in enumerate(handles):
            rng.map_unit(index, handle)
            rng.view(torch.uint8, (unit,), offset=index * unit).fill_(index + 1)
        rng.unmap_units(0, 2)
        assert not rng.is_mapped(0) and not rng.is_mapped(1) and rng.is_mapped(2)
        assert int(rng.view(torch.uint8, (unit,), offset=2 * unit)[0]) == 3
        rng.map_unit(0, handles[1])
        rng.map_unit(1, handles[0])
        rng.set_access(0, 2)
        assert int(rng.view(torch.uint8, (unit,))[0]) == 2 and int(rng.view(torch.uint8, (unit,), offset=unit)[0]) == 1
    finally:
        rng.close()
        for handle in handles:
            backend.release(handle)
