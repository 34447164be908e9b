"""Device selection for the whole suite.

``pytest --device=cpu`` (the default, what CI runs) selects tests marked ``cpu``; ``--device=cuda`` selects
tests marked ``cuda`` and fails at once when no NVIDIA GPU is present, so a CUDA session can never pass by
skipping. Every test must carry at least one device marker. Tests marked ``multi_gpu`` run only with ``--gpus N``
(N >= 2), which fails at once when fewer GPUs are present; without it they are deselected, never skipped.
"""

from __future__ import annotations

import gc
import os

import pytest

DEVICE_MARKERS = ("cpu", "cuda", "rocm")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", choices=DEVICE_MARKERS, default="cpu", help="which device marker to run")
    parser.addoption("--gpus", type=int, default=1, help="GPUs this run may use; >= 2 selects the multi_gpu tests")


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
    gpus = config.getoption("--gpus")
    if torch.cuda.device_count() < gpus:
        raise pytest.UsageError(f"--gpus={gpus} but torch sees {torch.cuda.device_count()} GPU(s)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    device = config.getoption("--device")
    unmarked = [item.nodeid for item in items if not any(item.get_closest_marker(m) for m in DEVICE_MARKERS)]
    if unmarked:
        raise pytest.UsageError(f"tests without a device marker (cpu/cuda/rocm): {unmarked[:10]}")
    multi = config.getoption("--gpus") >= 2

    def wanted(item: pytest.Item) -> bool:
        return bool(item.get_closest_marker(device)) and bool(item.get_closest_marker("multi_gpu")) == multi

    selected = [item for item in items if wanted(item)]
    deselected = [item for item in items if not wanted(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest):
    import torch

    name = request.config.getoption("--device")
    return torch.device("cpu" if name == "cpu" else "cuda")


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """A CUDA engine freezes the garbage collector at start-up and thaws it in ``close``; a test that drops its
    engine without closing it leaves the start-up objects frozen, and with them the cycles that hold its tensors."""
    yield
    gc.unfreeze()
