"""The VMM facade and its back-ends; ``open_backend`` picks one from the resolved platform."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastiserve.memory.errors import BackendUnavailable, VMMError
from elastiserve.memory.vmm.base import VMMBackend, check_aligned

if TYPE_CHECKING:
    import torch

__all__ = ["BACKENDS", "BackendUnavailable", "VMMBackend", "VMMError", "check_aligned", "open_backend"]

BACKENDS = ("cuda", "hip", "host")


def open_backend(name: str = "auto", device: torch.device | int | None = None) -> VMMBackend:
    """Open a VMM back-end. ``"auto"`` takes ``current_platform().vmm_backend``; an explicit name this machine
    cannot provide raises ``BackendUnavailable``."""
    if name == "auto":
        from elastiserve.platforms import current_platform

        name = current_platform().vmm_backend
    if name == "host":
        from elastiserve.memory.vmm.host import HostBackend

        return HostBackend()
    if name == "cuda":
        from elastiserve.memory.vmm.cuda import CudaBackend

        return CudaBackend(device)
    if name == "hip":
        from elastiserve.memory.vmm.hip import HipBackend

        return HipBackend(device)
    raise BackendUnavailable(f"unknown VMM back-end {name!r}; known: {', '.join(BACKENDS)}")
