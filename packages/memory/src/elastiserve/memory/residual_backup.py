"""The pinned host copy of every residual plane, and the one-shot startup copy to the device.

At startup many copies go back to back with no other PCIe traffic, so each residual is one asynchronous copy and one
event that the compute stream waits on (no host sync). Chunked copies are for the runtime restore path only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from elastiserve.memory.errors import ConfigError


class ResidualBackup:
    """Host bytes of each decoder layer's residual; pinned on a GPU so copies run at full PCIe bandwidth."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._host: dict[int, torch.Tensor] = {}

    @property
    def pinned(self) -> bool:
        return self.device.type == "cuda"

    def add(self, layer: int, data: torch.Tensor) -> torch.Tensor:
        """Keep a host copy of ``data`` (any dtype/device, read as raw bytes) as ``layer``'s residual."""
        if layer in self._host:
            raise ConfigError(f"layer {layer} already has a residual backup")
        raw = data.detach().contiguous().reshape(-1).view(torch.uint8)
        host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=self.pinned)
        host.copy_(raw)
        self._host[layer] = host
        return host

    def host(self, layer: int) -> torch.Tensor:
        return self._host[layer]

    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._host))

    def nbytes(self) -> int:
        return sum(t.numel() for t in self._host.values())


def one_shot_copy(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> object | None:
    """Copy each ``(dst, src)`` with one asynchronous transfer on a side stream; the compute stream waits on the
    returned event (a GPU-side wait). On the CPU the copies are synchronous and ``None`` is returned."""
    device = torch.device(device)
    if device.type != "cuda":
        for dst, src in pairs:
            dst.copy_(src)
        return None
    compute = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(compute)  # the destination may have just been written by the compute stream
    with torch.cuda.stream(stream):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        done = stream.record_event()
    compute.wait_event(done)
    return done
