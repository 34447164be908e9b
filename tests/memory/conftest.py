"""Memory-test fixtures: the VMM back-end that matches ``--device`` (host on the CPU, CUDA on an NVIDIA GPU)."""

from __future__ import annotations

import pytest

from elastiserve.memory.vmm import open_backend


@pytest.fixture(scope="session")
def backend(device):
    return open_backend("host" if device.type == "cpu" else "cuda", device)
