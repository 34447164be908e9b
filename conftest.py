"""Device selection for the whole suite.

``pytest --device=cpu`` (the default, what CI runs) selects tests marked ``cpu``; ``--device=cuda`` selects
tests marked ``cuda`` and fails at once when no NVIDIA GPU is present, so a CUDA session can never pass by
skipping. Every test must carry at least one device marker.
"""

from __future__ import annotations

import os

import pytest

DEVICE_MARKERS = ("cpu", "cuda", "rocm")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", choices=DEVICE_MARKERS, default="cpu", help="which device marker to run")


def pytest_configure(config: pytest.Config) -> None:
    device = config.getoption("--device")
    if device == "cpu":
        # Must be set before any module defines a @triton.jit kernel.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(f"--device={device} but torch sees no GPU: refusing to run (a skip would hide it)")
    is_hip = torch.version.hip is not None
    if (device == "rocm") != is_hip:
        raise pytest.UsageError(f"--device={device} but this GPU is {'ROCm' if is_hip else 'CUDA'}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    device = config.getoption("--device")
    unmarked = [item.nodeid for item in items if not any(item.get_closest_marker(m) for m in DEVICE_MARKERS)]
    if unmarked:
        raise pytest.UsageError(f"tests without a device marker (cpu/cuda/rocm): {unmarked[:10]}")
    selected = [item for item in items if item.get_closest_marker(device)]
    deselected = [item for item in items if not item.get_closest_marker(device)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest):
    import torch

    name = request.config.getoption("--device")
    return torch.device("cpu" if name == "cpu" else "cuda")
