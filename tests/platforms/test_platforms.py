"""Capability resolution: explicit requests that the machine cannot meet raise; env parsing is strict."""

import subprocess
import sys

import pytest

from elastiserve.platforms import ARCHS, BackendUnavailable, ConfigError, EnvSettings, FastGemm, resolve
from elastiserve.platforms.capability import _arch_of_amd, _arch_of_nvidia
from elastiserve.platforms.env import parse

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def test_env_parse_rejects_unknown_and_bad_values():
    with pytest.raises(ConfigError, match="ELASTISERVE_PLATFROM"):
        parse({"ELASTISERVE_PLATFROM": "cuda"})
    with pytest.raises(ConfigError, match="expected one of"):
        parse({"ELASTISERVE_VMM": "nvlink"})
    assert parse({"ELASTISERVE_PLATFORM": " CPU "}).platform == "cpu"
    assert parse({"ELASTISERVE_DEBUG_STACKS_S": "120"}).debug_stacks_s == 120.0
    assert parse({"ELASTISERVE_SOURCE_COMMIT": "AbC123"}).source_commit == "AbC123"  # case kept
    for bad in ("soon", "0", "-5"):
        with pytest.raises(ConfigError, match="DEBUG_STACKS_S"):
            parse({"ELASTISERVE_DEBUG_STACKS_S": bad})


def test_arch_tables():
    assert _arch_of_nvidia(9, 0) == "sm90"
    assert _arch_of_nvidia(8, 0) == "sm80"
    assert _arch_of_nvidia(8, 9) == "sm89"
    assert _arch_of_amd("gfx942:sramecc+:xnack-") == "gfx942"
    assert _arch_of_amd("gfx950") == "gfx950"
    with pytest.raises(BackendUnavailable):
        _arch_of_nvidia(7, 5)
    with pytest.raises(BackendUnavailable):
        _arch_of_amd("gfx1100")
    assert ARCHS["sm80"].fast_gemm is FastGemm.WEIGHT_ONLY
    assert ARCHS["gfx942"].fast_gemm is FastGemm.FP8_MMA_FNUZ and ARCHS["gfx942"].max_num_warps == 16
    assert not ARCHS["sm80"].native_fp8_dot and ARCHS["sm90"].native_fp8_dot


def test_resolve_matches_machine(device):
    platform = resolve(EnvSettings())
    assert platform.device_type == device.type
    if device.type == "cpu":
        assert platform.vmm_backend == "host"
    else:
        assert platform.vmm_backend in ("cuda", "hip")


@pytest.mark.parametrize("request_", ["cuda", "rocm"])
def test_unmet_explicit_request_raises(device, request_):
    import torch

    has = "rocm" if torch.version.hip else "cuda"
    if device.type == "cuda" and request_ == has:
        assert resolve(EnvSettings(platform=request_)).is_gpu
    else:
        with pytest.raises(BackendUnavailable):
            resolve(EnvSettings(platform=request_))


def test_import_does_not_import_torch():
    code = "import sys, elastiserve.platforms; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
