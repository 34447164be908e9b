"""One capability record for the machine, resolved once at runtime.

Facts per arch (Triton 3.6 backends, verified in the notes on formats and kernels):
- sm90 (H100/H200) and sm89: OCP fp8 (e4m3fn, e5m2) with native ``tl.dot`` (wgmma / mma).
- sm80 (A100): no e4m3fn dot; Triton promotes fp8 operands to fp16, so fast mode is weight-only.
- gfx942 (MI300): native MFMA only for FNUZ fp8; OCP bytes are reinterpreted (value / 2, 0x80 -> 0).
- gfx950 (MI355X): native OCP fp8 MFMA.
- HIP wavefronts allow at most 16 warps per program, CUDA 32.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from enum import StrEnum

from elastiserve.platforms.env import EnvSettings, settings, triton_interpret
from elastiserve.platforms.errors import BackendUnavailable

log = logging.getLogger(__name__)

MiB = 1 << 20


class Vendor(StrEnum):
    NVIDIA = "nvidia"
    AMD = "amd"
    CPU = "cpu"


class FastGemm(StrEnum):
    """How fast mode multiplies by the 8-bit upper plane on this arch."""

    FP8_MMA = "fp8_mma"  # native OCP fp8 MMA, dynamic per-token activation quantization
    FP8_MMA_FNUZ = "fp8_mma_fnuz"  # MI300: reinterpret OCP bytes as FNUZ (exact, scale x2)
    WEIGHT_ONLY = "weight_only"  # upcast the byte plane to fp16 in registers (W8A16)


@dataclass(frozen=True, slots=True)
class ArchFacts:
    arch: str
    fp8_flavor: str | None  # "ocp", "fnuz" or None
    triton_fp8_dtypes: tuple[str, ...]
    native_fp8_dot: bool
    fast_gemm: FastGemm
    max_num_warps: int
    vmm_granularity_hint: int  # bytes; the VMM back-end reports the real value


ARCHS: dict[str, ArchFacts] = {
    "sm90": ArchFacts("sm90", "ocp", ("fp8e5", "fp8e4nv"), True, FastGemm.FP8_MMA, 32, 2 * MiB),
    "sm89": ArchFacts("sm89", "ocp", ("fp8e5", "fp8e4nv"), True, FastGemm.FP8_MMA, 32, 2 * MiB),
    "sm80": ArchFacts("sm80", None, ("fp8e5",), False, FastGemm.WEIGHT_ONLY, 32, 2 * MiB),
    "gfx942": ArchFacts("gfx942", "fnuz", ("fp8e4b8", "fp8e5b16"), True, FastGemm.FP8_MMA_FNUZ, 16, 2 * MiB),
    "gfx950": ArchFacts("gfx950", "ocp", ("fp8e5", "fp8e4nv"), True, FastGemm.FP8_MMA, 16, 2 * MiB),
    "cpu": ArchFacts("cpu", None, (), False, FastGemm.WEIGHT_ONLY, 32, 4096),
}


@dataclass(frozen=True, slots=True)
class Platform:
    vendor: Vendor
    arch: str
    device_name: str
    device_type: str  # torch device type: "cuda" (also ROCm) or "cpu"
    facts: ArchFacts
    vmm_backend: str  # "cuda", "hip" or "host"
    kernel_backend: str  # "triton" or "reference"
    num_sms: int
    l2_bytes: int
    # Triton kernels launched with programmatic dependent launch (``kernels/launch.py``): sm90+ only, and only
    # where ELASTISERVE_PDL asks or PDL_BY_DEFAULT says so.
    programmatic_launch: bool = False

    @property
    def is_gpu(self) -> bool:
        return self.vendor is not Vendor.CPU

    @property
    def fast_gemm(self) -> FastGemm:
        return self.facts.fast_gemm

    @property
    def max_num_warps(self) -> int:
        return self.facts.max_num_warps


# Archs whose GPUs launch a kernel while the one before it drains (griddepcontrol, PTX ISA 7.8, sm90+).
PDL_ARCHS = ("sm90",)
# Whether ELASTISERVE_PDL=auto turns it on, per arch. sm90: a Llama-3.1-8B decode step (CUDA-graph replay) on the
# H200, side by side (session 19, benchmarks/engine/results/h200-llama8b-decode-s19-pdl-{on,off}.json): static-fp16
# batch 1 4.640 -> 4.402 ms; fast/full 1.43 / 1.51 / 1.59 / 1.58 / 1.56 / 1.62x -> 1.49 / 1.57 / 1.67 / 1.66 / 1.61 /
# 1.72x at batches 1 / 2 / 4 / 8 / 16 / 32. Tokens and logits bit-equal on and off (test_programmatic_launch_cuda).
PDL_BY_DEFAULT: dict[str, bool] = {"sm90": True}


def _arch_of_nvidia(major: int, minor: int) -> str:
    if major >= 9:
        return "sm90"
    if (major, minor) >= (8, 9):
        return "sm89"
    if major == 8:
        return "sm80"
    raise BackendUnavailable(f"NVIDIA compute capability {major}.{minor} is older than sm80, which elastiserve needs")


def _arch_of_amd(gcn_arch_name: str) -> str:
    base = gcn_arch_name.split(":")[0]
    if base in ("gfx940", "gfx941", "gfx942"):
        return "gfx942"
    if base == "gfx950":
        return "gfx950"
    raise BackendUnavailable(f"AMD arch {gcn_arch_name!r} is not one elastiserve supports (gfx942, gfx950)")


def _detect_gpu() -> Platform | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    if torch.version.hip is not None:
        vendor, arch, vmm = Vendor.AMD, _arch_of_amd(props.gcnArchName), "hip"
    else:
        vendor, arch, vmm = Vendor.NVIDIA, _arch_of_nvidia(props.major, props.minor), "cuda"
    l2 = int(getattr(props, "L2_cache_size", 0))
    return Platform(vendor, arch, props.name, "cuda", ARCHS[arch], vmm, "triton", props.multi_processor_count, l2)


def _cpu_platform(kernels: str) -> Platform:
    import os

    # On the CPU the reference ops serve the engine; Triton runs only interpreted, for tests.
    backend = "triton" if kernels == "triton" or (kernels == "auto" and triton_interpret()) else "reference"
    if backend == "triton" and not triton_interpret():
        raise BackendUnavailable("ELASTISERVE_KERNELS=triton on the CPU needs TRITON_INTERPRET=1")
    return Platform(Vendor.CPU, "cpu", "cpu", "cpu", ARCHS["cpu"], "host", backend, os.cpu_count() or 1, 0)


def resolve(env: EnvSettings) -> Platform:
    """Resolve the platform for ``env``; an explicit request this machine cannot meet raises."""
    gpu = None if env.platform == "cpu" else _detect_gpu()
    if env.platform in ("cuda", "rocm"):
        want = Vendor.NVIDIA if env.platform == "cuda" else Vendor.AMD
        if gpu is None or gpu.vendor is not want:
            found = gpu.device_name if gpu else "no GPU"
            raise BackendUnavailable(f"ELASTISERVE_PLATFORM={env.platform} requested, but this machine has {found}")
    platform = gpu or _cpu_platform(env.kernels)
    if platform.is_gpu and env.kernels == "reference":
        platform = _replace(platform, kernel_backend="reference")
    if env.vmm != "auto" and env.vmm != platform.vmm_backend:
        if env.vmm != "host":
            raise BackendUnavailable(f"ELASTISERVE_VMM={env.vmm} requested on a {platform.vendor.value} platform")
        platform = _replace(platform, vmm_backend="host")
    platform = _replace(platform, programmatic_launch=_programmatic_launch(env, platform))
    if env.platform == "auto" and not platform.is_gpu:
        log.info("no GPU found: running on the CPU with the host VMM back-end and %s kernels", platform.kernel_backend)
    return platform


def _programmatic_launch(env: EnvSettings, platform: Platform) -> bool:
    able = platform.vendor is Vendor.NVIDIA and platform.arch in PDL_ARCHS and platform.kernel_backend == "triton" \
        and not triton_interpret()
    if env.pdl == "on" and not able:
        raise BackendUnavailable(f"ELASTISERVE_PDL=on requested, but {platform.device_name} ({platform.arch}, "
                                 f"{platform.kernel_backend} kernels) cannot launch programmatically dependent grids")
    if env.pdl == "auto":
        return able and PDL_BY_DEFAULT.get(platform.arch, False)
    return able and env.pdl == "on"


def _replace(platform: Platform, **changes: object) -> Platform:
    import dataclasses

    return dataclasses.replace(platform, **changes)


@functools.cache
def current_platform() -> Platform:
    return resolve(settings())
