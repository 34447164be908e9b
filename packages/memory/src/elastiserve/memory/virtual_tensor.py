"""A reserved virtual range split into units, each mapped to a physical handle, viewed as a torch tensor."""

from __future__ import annotations

import math
from typing import Any

import torch

from elastiserve.memory.errors import VMMError
from elastiserve.memory.vmm.base import VMMBackend


class VirtualRange:
    """``nbytes`` of virtual addresses rounded up to whole ``unit_bytes`` units (default: the granularity).

    Example::

        rng = VirtualRange(backend, 3 * unit)
        rng.map_unit(0, handle)
        rng.view(torch.float16, (unit // 2,))  # zero-copy over unit 0
    """

    def __init__(self, backend: VMMBackend, nbytes: int, *, unit_bytes: int | None = None) -> None:
        unit = unit_bytes or backend.granularity()
        if unit % backend.granularity():
            raise VMMError(f"unit_bytes={unit} is not a multiple of the granularity {backend.granularity()}")
        self.backend = backend
        self.unit_bytes = unit
        self.num_units = max(1, math.ceil(nbytes / unit))
        self.nbytes = self.num_units * unit
        self.va = backend.reserve(self.nbytes)
        self._handles: dict[int, Any] = {}
        self._multi_unmap = True

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_units:
            raise VMMError(f"unit index {index} outside [0, {self.num_units})")

    def unit_va(self, index: int) -> int:
        self._check_index(index)
        return self.va + index * self.unit_bytes

    def is_mapped(self, index: int) -> bool:
        return index in self._handles

    def handle_at(self, index: int) -> Any:
        return self._handles.get(index)

    def map_unit(self, index: int, handle: Any, *, set_access: bool = True) -> None:
        """Map ``handle`` at unit ``index``; ``set_access=False`` lets a caller grant access to a run at once."""
        if index in self._handles:
            raise VMMError(f"unit {index} of the range at {self.va:#x} is already mapped")
        va = self.unit_va(index)
        self.backend.map(va, self.unit_bytes, handle)
        self._handles[index] = handle
        if set_access:
            self.backend.set_access(va, self.unit_bytes)

    def set_access(self, first: int, count: int) -> None:
        """Grant read-write access to ``count`` mapped units from ``first`` with one driver call."""
        self._check_index(first + count - 1)
        self.backend.set_access(self.unit_va(first), count * self.unit_bytes)

    def unmap_unit(self, index: int) -> None:
        """Drop the mapping at ``index``; an unmapped index is left as it is (a retried restore re-unmaps)."""
        if self._handles.pop(index, None) is not None:
            self.backend.unmap(self.unit_va(index), self.unit_bytes)

    def unmap_units(self, first: int, count: int) -> None:
        """Drop the mappings of ``count`` slots from ``first``: one driver call when every slot is mapped and the
        back-end accepts a range spanning several mappings, else slot by slot."""
        indices = range(first, first + count)
        if count > 1 and self._multi_unmap and all(i in self._handles for i in indices):
            try:
                self.backend.unmap(self.unit_va(first), count * self.unit_bytes)
            except VMMError:
                self._multi_unmap = False  # remember: this back-end wants one call per mapping
            else:
                for index in indices:
                    del self._handles[index]
                return
        for index in indices:
            self.unmap_unit(index)

    def view(self, dtype: torch.dtype = torch.uint8, shape: tuple[int, ...] | None = None, *,
             offset: int = 0) -> torch.Tensor:
        """Zero-copy tensor of ``dtype``/``shape`` starting ``offset`` bytes in (default: the whole range)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        count = (self.nbytes - offset) // itemsize if shape is None else math.prod(shape)
        nbytes = count * itemsize
        if offset < 0 or offset % itemsize or offset + nbytes > self.nbytes:
            raise VMMError(f"view of {nbytes} bytes at offset {offset} does not fit the {self.nbytes}-byte range")
        flat = self.backend.tensor_view(self.va + offset, nbytes).view(dtype)
        return flat if shape is None else flat.view(shape)

    def close(self) -> None:
        """Unmap every unit and free the reservation (handles stay alive: their owner releases them)."""
        for index in sorted(self._handles):
            self.unmap_unit(index)
        if self.va:
            self.backend.free_reservation(self.va, self.nbytes)
            self.va = 0

    def __enter__(self) -> VirtualRange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
