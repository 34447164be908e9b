"""The HIP back-end against a binding-level fake that enforces ROCm's VMM quirks (the real one is unverified on AMD
hardware): aligned reserves that fail are retried with alignment 0 and the address checked, maps use offset 0, the
allocation prop uses ``requestedHandleType``, and a released handle's VRAM comes back by re-reserving the range."""

from __future__ import annotations

import pytest
from fake_hip import FakeHip  # tests/memory is on sys.path (rootdir-relative test modules)

from elastiserve.memory.errors import VMMError
from elastiserve.memory.virtual_tensor import VirtualRange
from elastiserve.memory.vmm.hip import HipBackend

pytestmark = [pytest.mark.cpu]

GRAN = FakeHip.GRANULARITY


def test_failed_aligned_reserve_is_retried_with_alignment_zero():
    fake = FakeHip(aligned_reserve_fails_every=1)
    backend = HipBackend(bindings=fake)
    va = backend.reserve(4 * GRAN)
    assert va % GRAN == 0
    assert [c.split(",")[1].strip() for c in fake.calls] == ["align=0x200000", "align=0x0"]
    backend.free_reservation(va, 4 * GRAN)
    assert fake.reservations == {}


def test_misaligned_reserve_is_over_reserved_and_aligned():
    fake = FakeHip(aligned_reserve_fails_every=1, misalign_unaligned=True)
    backend = HipBackend(bindings=fake)
    va = backend.reserve(2 * GRAN)
    assert va % GRAN == 0
    (base, size), = fake.reservations.items()
    assert base <= va and va + 2 * GRAN <= base + size
    handle = backend.create(GRAN)
    backend.map(va + GRAN, GRAN, handle)
    backend.set_access(va + GRAN, GRAN)
    assert va + GRAN in fake.accessible
    backend.unmap(va + GRAN, GRAN)
    backend.free_reservation(va, 2 * GRAN)
    assert fake.reservations == {}


def test_release_while_reserved_rereserves_to_return_vram():
    fake = FakeHip()
    backend = HipBackend(bindings=fake)
    with VirtualRange(backend, 2 * GRAN) as rng:
        handle = backend.create(GRAN)
        rng.map_unit(0, handle)
        assert fake.used_bytes == GRAN
        rng.unmap_unit(0)
        backend.release(handle)
        assert fake.used_bytes == 0  # without the re-reserve the fake would still account the released handle
        assert rng.va in fake.reservations  # the caller's address is still reserved
        again = backend.create(GRAN)
        rng.map_unit(1, again)
        rng.unmap_unit(1)
        backend.release(again)
    assert fake.used_bytes == 0 and fake.reservations == {}


def test_release_with_live_mappings_defers_the_rereserve():
    fake = FakeHip()
    backend = HipBackend(bindings=fake)
    rng = VirtualRange(backend, 2 * GRAN)
    a, b = backend.create(GRAN), backend.create(GRAN)
    rng.map_unit(0, a)
    rng.map_unit(1, b)
    rng.unmap_unit(0)
    backend.release(a)
    assert fake.used_bytes == 2 * GRAN  # b is still mapped: the range cannot be re-reserved yet
    rng.unmap_unit(1)  # last mapping gone: re-reserve now, a's memory comes back
    assert fake.used_bytes == GRAN
    rng.close()
    backend.release(b)
    assert fake.used_bytes == 0


def test_fake_enforces_the_rules_the_backend_relies_on():
    fake = FakeHip()
    handle = fake.hipMemCreate(GRAN, fake.hipMemAllocationProp(), 0)[1]
    _, base = fake.hipMemAddressReserve(GRAN, 0, 0, 0)
    assert fake.hipMemMap(base, GRAN, GRAN, handle, 0)[0] != fake.hipError_t.hipSuccess  # nonzero offset refused
    with pytest.raises(AttributeError):
        fake.hipMemAllocationProp().requestedHandleTypes = 0
    backend = HipBackend(bindings=fake)
    with pytest.raises(VMMError, match="no reservation"):
        backend.map(base, GRAN, handle)  # not a reservation of this back-end
    own = backend.reserve(GRAN)
    backend.release(handle)
    with pytest.raises(VMMError, match="hipMemMap"):
        backend.map(own, GRAN, handle)  # the driver's refusal (released handle) becomes a typed error


def test_unmap_of_a_run_falls_back_to_one_call_per_mapping():
    fake = FakeHip()
    backend = HipBackend(bindings=fake)
    with VirtualRange(backend, 3 * GRAN) as rng:
        handles = [backend.create(GRAN) for _ in range(3)]
        for index, handle in enumerate(handles):
            rng.map_unit(index, handle)
        rng.unmap_units(0, 3)  # the fake refuses a range spanning mappings, like a strict driver would
        assert fake.mappings == {} and not any(rng.is_mapped(i) for i in range(3))
        for handle in handles:
            backend.release(handle)
    assert fake.used_bytes == 0
