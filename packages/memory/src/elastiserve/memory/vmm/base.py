"""The VMM facade: the vocabulary every back-end speaks (reserve / create / map / set_access / unmap / release)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from elastiserve.memory.errors import VMMError

if TYPE_CHECKING:
    import torch


@runtime_checkable
class VMMBackend(Protocol):
    """Physical handles mapped into reserved virtual ranges.

    Sizes and addresses passed to ``map``/``unmap``/``set_access`` must be multiples of ``granularity()``.
    A range may be mapped by one handle at a time; a handle may be mapped at any number of addresses (aliasing).
    """

    name: str

    @property
    def device(self) -> torch.device: ...

    def granularity(self) -> int: ...

    def reserve(self, size: int) -> int: ...

    def free_reservation(self, va: int, size: int) -> None: ...

    def create(self, size: int) -> Any: ...

    def release(self, handle: Any) -> None: ...

    def map(self, va: int, size: int, handle: Any) -> None: ...

    def unmap(self, va: int, size: int) -> None: ...

    def set_access(self, va: int, size: int) -> None: ...

    def tensor_view(self, va: int, nbytes: int) -> torch.Tensor:
        """A zero-copy uint8 tensor over ``nbytes`` of mapped memory at ``va``; callers ``.view(dtype)``/reshape.

        The tensor does not keep the mapping alive: touching it after ``unmap``/``free_reservation`` faults.
        """
        ...


def check_aligned(what: str, value: int, granularity: int) -> None:
    if value <= 0 and what.endswith("size"):
        raise VMMError(f"{what}={value}: must be positive")
    if value % granularity:
        raise VMMError(f"{what}={value:#x} is not a multiple of the VMM granularity {granularity:#x}")


class DeviceArray:
    """``__cuda_array_interface__`` over raw device bytes, so ``torch.as_tensor(obj, device='cuda')`` is zero-copy."""

    def __init__(self, va: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (va, False), "version": 3}


def device_tensor_view(va: int, nbytes: int, device: torch.device) -> torch.Tensor:
    import torch

    tensor = torch.as_tensor(DeviceArray(va, nbytes), device=device)
    if tensor.data_ptr() != va:  # torch would have copied: the view must alias the mapping
        raise VMMError(f"torch.as_tensor copied the range at {va:#x} instead of aliasing it")
    return tensor


def cuda_device_index(device: torch.device | int | str | None) -> int:
    import torch

    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index
