"""Capability resolution: explicit requests that the machine cannot meet raise; env parsing is strict."""

import subprocess
import sys

import pytest

from elastiserve.platforms import ARCHS, BackendUnavailable, ConfigError, EnvSettings, FastGemm, resolve
from elastiserve.platforms.capability import PDL_ARCHS, PDL_BY_DEFAULT, _arch_of_amd, _arch_of_nvidia
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


def test_programmatic_launch_only_where_the_gpu_can(device):
    """ELASTISERVE_PDL: "off" always resolves, "on" raises unless the platform is an sm90 GPU running compiled Triton
    kernels, "auto" follows PDL_BY_DEFAULT; the interpreter and the reference kernels never launch that way."""
    with pytest.raises(ConfigError, match="ELASTISERVE_PDL"):
        parse({"ELASTISERVE_PDL": "maybe"})
    assert parse({"ELASTISERVE_PDL": "On"}).pdl == "on"
    assert not resolve(EnvSettings(pdl="off")).programmatic_launch
    with pytest.raises(BackendUnavailable, match="ELASTISERVE_PDL=on"):
        resolve(EnvSettings(pdl="on", kernels="reference"))
    platform = resolve(EnvSettings())
    able = platform.arch in PDL_ARCHS and platform.kernel_backend == "triton" and device.type == "cuda"
    if able:
        assert resolve(EnvSettings(pdl="on")).programmatic_launch
        assert platform.programmatic_launch == PDL_BY_DEFAULT.get(platform.arch, False)
    else:
        assert not platform.programmatic_launch
        with pytest.raises(BackendUnavailable, match="ELASTISERVE_PDL=on"):
            resolve(EnvSettings(pdl="on"))


def test_import_does_not_import_torch():
    code = "import sys, elastiserve.platforms; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
