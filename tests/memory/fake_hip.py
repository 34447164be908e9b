"""A binding-level stand-in for hip-python's ``hip`` module that enforces the ROCm VMM behaviours we guard against.

- ``hipMemAddressReserve`` with a nonzero alignment fails on every ``aligned_reserve_fails_every``-th call, and
  with ``misalign_unaligned=True`` an alignment-0 reservation comes back off the granularity.
- ``hipMemMap`` refuses a nonzero offset.
- a released handle's memory stays accounted (``used_bytes``) until every reservation it was mapped into is freed.
- ``hipMemAllocationProp`` has ``requestedHandleType`` only (setting ``requestedHandleTypes`` raises).
"""

from __future__ import annotations

from enum import IntEnum


class hipError_t(IntEnum):
    hipSuccess = 0
    hipErrorInvalidValue = 1
    hipErrorOutOfMemory = 2


class hipMemAllocationType(IntEnum):
    hipMemAllocationTypePinned = 1


class hipMemLocationType(IntEnum):
    hipMemLocationTypeDevice = 1


class hipMemAccessFlags(IntEnum):
    hipMemAccessFlagsProtReadWrite = 3


class hipMemAllocationGranularity_flags(IntEnum):
    hipMemAllocationGranularityMinimum = 0
    hipMemAllocationGranularityRecommended = 1


class hipMemAllocationHandleType(IntEnum):
    hipMemHandleTypeNone = 0


class hipMemLocation:
    __slots__ = ("id", "type")

    def __init__(self) -> None:
        self.type, self.id = 0, 0


class hipMemAllocationProp:
    __slots__ = ("location", "requestedHandleType", "type")

    def __init__(self) -> None:
        self.type, self.location, self.requestedHandleType = 0, hipMemLocation(), None


class hipMemAccessDesc:
    __slots__ = ("flags", "location")

    def __init__(self) -> None:
        self.location, self.flags = hipMemLocation(), 0


class FakeHandle:
    def __init__(self, size: int) -> None:
        self.size = size
        self.released = False
        self.reservations: set[int] = set()  # bases of reservations it was ever mapped into


class FakeHip:
    GRANULARITY = 2 << 20
    BASE_VA = 0x7F00_0000_0000

    def __init__(self, *, capacity: int = 64 << 20, aligned_reserve_fails_every: int = 2,
                 misalign_unaligned: bool = False) -> None:
        for name, value in globals().items():
            if name.startswith("hip"):
                setattr(self, name, value)
        self.capacity = capacity
        self.aligned_reserve_fails_every = aligned_reserve_fails_every
        self.misalign_unaligned = misalign_unaligned
        self.reservations: dict[int, int] = {}  # base -> size
        self.mappings: dict[int, tuple[int, FakeHandle]] = {}  # va -> (size, handle)
        self.accessible: set[int] = set()
        self.handles: list[FakeHandle] = []
        self.calls: list[str] = []
        self._aligned_calls = 0
        self._next_va = self.BASE_VA

    @property
    def used_bytes(self) -> int:
        return sum(h.size for h in self.handles if not h.released or h.reservations)

    def _ok(self, *values):
        return (hipError_t.hipSuccess, *values)

    def _bad(self, err=hipError_t.hipErrorInvalidValue):
        return (err, None)

    def hipMemGetAllocationGranularity(self, prop, option):
        prop.requestedHandleType  # noqa: B018 (AttributeError if the caller built the wrong struct)
        return self._ok(self.GRANULARITY)

    def _overlaps(self, base: int, size: int) -> bool:
        return any(b < base + size and base < b + s for b, s in self.reservations.items())

    def hipMemAddressReserve(self, size, alignment, addr, flags):
        self.calls.append(f"reserve({size:#x}, align={alignment:#x}, addr={addr:#x})")
        if alignment:
            self._aligned_calls += 1
            if self._aligned_calls % self.aligned_reserve_fails_every == 0:
                return self._bad(hipError_t.hipErrorOutOfMemory)
        if addr and not self._overlaps(addr, size):
            base = addr
        else:
            base = self._next_va + (4096 if not alignment and self.misalign_unaligned else 0)
            self._next_va += size + 2 * self.GRANULARITY
        self.reservations[base] = size
        return self._ok(base)

    def hipMemAddressFree(self, ptr, size):
        if self.reservations.get(ptr) != size or any(ptr <= va < ptr + size for va in self.mappings):
            return (hipError_t.hipErrorInvalidValue,)
        del self.reservations[ptr]
        for handle in self.handles:
            handle.reservations.discard(ptr)
        return (hipError_t.hipSuccess,)

    def hipMemCreate(self, size, prop, flags):
        if size % self.GRANULARITY or self.used_bytes + size > self.capacity:
            return self._bad(hipError_t.hipErrorOutOfMemory)
        handle = FakeHandle(size)
        self.handles.append(handle)
        return self._ok(handle)

    def hipMemRelease(self, handle):
        if handle.released:
            return (hipError_t.hipErrorInvalidValue,)
        handle.released = True
        return (hipError_t.hipSuccess,)

    def _reservation_of(self, va: int, size: int) -> int | None:
        return next((b for b, s in self.reservations.items() if b <= va and va + size <= b + s), None)

    def hipMemMap(self, ptr, size, offset, handle, flags):
        base = self._reservation_of(ptr, size)
        clash = any(va < ptr + size and ptr < va + s for va, (s, _) in self.mappings.items())
        if offset != 0 or base is None or clash or handle.released or size > handle.size:
            return (hipError_t.hipErrorInvalidValue,)
        self.mappings[ptr] = (size, handle)
        handle.reservations.add(base)
        return (hipError_t.hipSuccess,)

    def hipMemUnmap(self, ptr, size):
        if self.mappings.get(ptr, (None,))[0] != size:
            return (hipError_t.hipErrorInvalidValue,)
        del self.mappings[ptr]
        self.accessible.discard(ptr)
        return (hipError_t.hipSuccess,)

    def hipMemSetAccess(self, ptr, size, desc, count):
        covered = sum(s for va, (s, _) in self.mappings.items() if ptr <= va and va + s <= ptr + size)
        if covered != size or count != len(desc):
            return (hipError_t.hipErrorInvalidValue,)
        self.accessible.update(va for va in self.mappings if ptr <= va < ptr + size)
        return (hipError_t.hipSuccess,)
