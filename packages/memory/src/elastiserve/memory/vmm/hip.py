"""HIP VMM back-end over hip-python (``from hip import hip``).

UNVERIFIED ON AMD HARDWARE: this module has only run against the binding-level fake in ``tests/memory/fake_hip.py``,
which enforces the ROCm behaviours below. It needs a run on an MI300/MI355 before anyone relies on it.

ROCm pitfalls handled here:
- After ``hipMemRelease`` the VRAM is not given back while a reservation it was mapped into is still held, so when
  a released handle leaves a reservation with no live mappings, the range is freed and re-reserved at the same
  address (the address stays valid for the caller, the memory returns to the device).
- ``hipMemAddressReserve`` with an explicit alignment can fail: retry with alignment 0 and check that the address
  is aligned; if not, over-reserve by one granule and use the aligned address inside.
- ``hipMemMap`` accepts only offset 0.
- ``hipMemAllocationProp`` has ``requestedHandleType`` (singular), unlike CUDA's ``requestedHandleTypes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from elastiserve.memory.errors import BackendUnavailable, VMMError
from elastiserve.memory.vmm.base import check_aligned, cuda_device_index, device_tensor_view


def _import_hip() -> Any:
    if not torch.cuda.is_available() or torch.version.hip is None:
        raise BackendUnavailable("the HIP VMM back-end needs an AMD GPU visible to a ROCm build of torch")
    try:
        from hip import hip
    except ImportError as exc:
        raise BackendUnavailable("the HIP VMM back-end needs hip-python (pip install hip-python)") from exc
    return hip


@dataclass(slots=True)
class _Reservation:
    base: int  # what hipMemAddressReserve returned (may be below ``va`` after an over-reserve)
    base_size: int
    va: int
    size: int
    live: dict[int, tuple[int, Any]] = field(default_factory=dict)  # va -> (size, handle)
    holds_released_memory: bool = False


class HipBackend:
    """``VMMBackend`` over hipMemAddressReserve / hipMemCreate / hipMemMap / hipMemSetAccess (unverified on AMD)."""

    name = "hip"

    def __init__(self, device: torch.device | int | None = None, *, bindings: Any = None) -> None:
        self._hip = bindings if bindings is not None else _import_hip()
        index = 0 if bindings is not None and device is None else cuda_device_index(device)
        self._device = torch.device("cuda", index)
        hip = self._hip
        self._prop = hip.hipMemAllocationProp()
        self._prop.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
        self._prop.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        self._prop.location.id = index
        self._prop.requestedHandleType = hip.hipMemAllocationHandleType.hipMemHandleTypeNone
        flag = hip.hipMemAllocationGranularity_flags.hipMemAllocationGranularityRecommended
        (granularity,) = self._call("hipMemGetAllocationGranularity", hip.hipMemGetAllocationGranularity(
            self._prop, flag))
        self._granularity = int(granularity)
        self._access = hip.hipMemAccessDesc()
        self._access.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        self._access.location.id = index
        self._access.flags = hip.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
        self._reservations: dict[int, _Reservation] = {}
        self._seen_in: dict[int, set[int]] = {}  # id(handle) -> reservations it was mapped into

    @property
    def device(self) -> torch.device:
        return self._device

    def granularity(self) -> int:
        return self._granularity

    def _call(self, what: str, result: Any) -> tuple:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._hip.hipError_t.hipSuccess:
            raise VMMError(f"{what} failed: {err!r}")
        return tuple(values)

    def _try_reserve(self, size: int, alignment: int, addr: int) -> int | None:
        err, *values = self._hip.hipMemAddressReserve(size, alignment, addr, 0)
        return int(values[0]) if err == self._hip.hipError_t.hipSuccess else None

    def reserve(self, size: int) -> int:
        check_aligned("reserve size", size, self._granularity)
        gran = self._granularity
        base = self._try_reserve(size, gran, 0)
        if base is None:  # ROCm: an explicit alignment can fail where alignment 0 succeeds
            base = self._try_reserve(size, 0, 0)
        if base is None:
            raise VMMError(f"hipMemAddressReserve({size:#x}) failed with alignment {gran:#x} and 0")
        reservation = _Reservation(base, size, base, size)
        if base % gran:
            self._call("hipMemAddressFree", self._hip.hipMemAddressFree(base, size))
            wide = self._try_reserve(size + gran, 0, 0)
            if wide is None:
                raise VMMError(f"hipMemAddressReserve({size + gran:#x}) for an aligned over-reserve failed")
            reservation = _Reservation(wide, size + gran, -(-wide // gran) * gran, size)
        self._reservations[reservation.va] = reservation
        return reservation.va

    def free_reservation(self, va: int, size: int) -> None:
        reservation = self._reservations.get(va)
        if reservation is None or reservation.size != size:
            raise VMMError(f"free_reservation({va:#x}, {size:#x}): no such reservation")
        if reservation.live:
            raise VMMError(f"free_reservation({va:#x}): {len(reservation.live)} mappings are still live")
        self._call("hipMemAddressFree", self._hip.hipMemAddressFree(reservation.base, reservation.base_size))
        del self._reservations[va]
        for seen in self._seen_in.values():
            seen.discard(va)

    def create(self, size: int) -> Any:
        check_aligned("create size", size, self._granularity)
        (handle,) = self._call("hipMemCreate", self._hip.hipMemCreate(size, self._prop, 0))
        self._seen_in[id(handle)] = set()
        return handle

    def release(self, handle: Any) -> None:
        self._call("hipMemRelease", self._hip.hipMemRelease(handle))
        for va in self._seen_in.pop(id(handle), set()):
            reservation = self._reservations[va]
            reservation.holds_released_memory = True
            if not reservation.live:
                self._rereserve(reservation)

    def _rereserve(self, reservation: _Reservation) -> None:
        """Free and reserve the same range again so ROCm returns the released handles' VRAM."""
        self._call("hipMemAddressFree", self._hip.hipMemAddressFree(reservation.base, reservation.base_size))
        again = self._try_reserve(reservation.base_size, 0, reservation.base)
        if again != reservation.base:
            if again is not None:
                self._hip.hipMemAddressFree(again, reservation.base_size)
            del self._reservations[reservation.va]
            raise VMMError(f"re-reserving {reservation.base:#x} after hipMemRelease returned {again!r}")
        reservation.holds_released_memory = False

    def _reservation_of(self, va: int, size: int) -> _Reservation:
        for reservation in self._reservations.values():
            if reservation.va <= va and va + size <= reservation.va + reservation.size:
                return reservation
        raise VMMError(f"range [{va:#x}, +{size:#x}) lies in no reservation of this back-end")

    def map(self, va: int, size: int, handle: Any) -> None:
        check_aligned("map va", va, self._granularity)
        check_aligned("map size", size, self._granularity)
        reservation = self._reservation_of(va, size)
        self._call("hipMemMap", self._hip.hipMemMap(va, size, 0, handle, 0))  # ROCm: offset must be 0
        reservation.live[va] = (size, handle)
        self._seen_in.setdefault(id(handle), set()).add(reservation.va)

    def unmap(self, va: int, size: int) -> None:
        reservation = self._reservation_of(va, size)
        self._call("hipMemUnmap", self._hip.hipMemUnmap(va, size))
        reservation.live.pop(va, None)
        if reservation.holds_released_memory and not reservation.live:
            self._rereserve(reservation)

    def set_access(self, va: int, size: int) -> None:
        self._call("hipMemSetAccess", self._hip.hipMemSetAccess(va, size, [self._access], 1))

    def tensor_view(self, va: int, nbytes: int) -> torch.Tensor:
        return device_tensor_view(va, nbytes, self._device)
