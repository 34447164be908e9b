"""Tile configurations of the skinny (GEMV-style) decode GEMM (``skinny_gemm.py``): which rows take it per arch and
mode (``SKINNY_MAX_M``), its tiles, and the occupancy split-K. The tl.dot GEMMs' tables are in ``configs.py``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from elastiserve.kernels.configs import MODES, _split_for_occupancy
from elastiserve.platforms import ConfigError

SKINNY_MODES = ("plain", "full", "weight_only")  # plain: an fp16 weight [N, K]; the others read nested planes
SKINNY_MAX_ROWS = 8  # the kernel keeps one accumulator per row, eight at most (skinny_gemm.py says why)
SKINNY_MAX_TILE = 32768  # BLOCK_N * BLOCK_K elements: 128 bytes of nested planes per thread at 8 warps


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    ptx_decode: bool = False  # nested planes only, NVIDIA only (nested_gemm.check_ptx_decode)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ConfigError(f"SkinnyConfig.{name}={value} must be a power of two")
        if self.block_k < 16 or self.block_n * self.block_k > SKINNY_MAX_TILE:
            raise ConfigError(f"SkinnyConfig needs block_k >= 16, block_n * block_k <= {SKINNY_MAX_TILE}: {self}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ConfigError(f"split_k and num_stages must be >= 1, got {self}")


# Largest M that takes the skinny kernel, per arch and mode; an arch or mode not listed never takes it. sm90 from the
# H200 probe (benchmarks/kernels/results/h200-skinny-probe-run1.json; Llama-3.1-8B qkv / o / gate_up / down, CUDA
# graphs over weights past the L2): at M = 1 the skinny kernel beat cuBLAS fp16 on every shape in every mode (plain
# 1.04-1.26x, full 1.06-1.30x, weight-only 1.67-1.87x) and the tl.dot nested kernel (full 1.18-1.26x, weight-only
# 1.20-1.53x); at M = 2 only full mode still beat the tl.dot kernel on all four (1.05-1.11x); from M = 4 it lost.
# Plain at M = 2 since session 24: after session 22's per-load accumulators the kernel read lm_head (128256 x 4096,
# 1.05 GB) at two rows in 229.6 us against cuBLAS's 272.7 (session 23, call 1; 4x2048 at 8 warps), and full mode,
# which reads the same bytes, beat cuBLAS fp16 at two rows on all four shapes (h200-skinny-vec-s22-m2.json).
# Other GPU archs are not timed: empty. The interpreter takes every M so the CPU tests reach it through the dispatch.
SKINNY_MAX_M: dict[str, dict[str, int]] = {
    "sm90": {"plain": 2, "full": 2, "weight_only": 1}, "sm89": {}, "sm80": {}, "gfx942": {}, "gfx950": {},
    "cpu": dict.fromkeys(SKINNY_MODES, SKINNY_MAX_ROWS),
}
# sm90 tiles since the per-load accumulators (session 22, benchmarks/kernels/results/h200-skinny-vec-s22-m{1,2}.json:
# qkv / o / gate_up / down of Llama-3.1-8B, graph replay past the L2, one run), per mode and M the tile with the best
# geomean over the four shapes; us per call (the session-21 tile on the same kernel in brackets):
# - weight-only, 1 row, 16x2048 at 16 warps: 9.0 / 6.3 / 33.6 / 16.8 (8x1024x8: 10.4 / 7.3 / 33.7 / 20.7; the old
#   whole-tile-accumulator kernel's best, 6.61 on o and 17.79 on down, session 21);
# - full, 1 row, 8x2048 at 8 warps: 14.1 / 10.3 / 55.3 / 29.8 (8x512x4: 15.9 / 10.2 / 54.9 / 31.1);
# - full, 2 rows, 8x1024 at 8 warps: 15.4 / 10.7 / 58.6 / 29.9 (8x512x4: 17.2 / 11.0 / 56.4 / 32.5);
# - plain, 1 row, 4x4096 at 16 warps: 13.2 / 9.5 / 54.3 / 30.7 (16x1024x8: 15.9 / 9.6 / 56.1 / 30.1), gate_up 4.33 TB/s.
# Weight-only layers of SKINNY_WIDE_N columns or more (gate_up) take _SKINNY_SM90_WIDE: 31.3 us against 33.6, and
# torch._scaled_mm's 32.5 in session 22's GEMM table.
_SKINNY_SM90 = {
    ("plain", 1): SkinnyConfig(4, 4096, num_warps=16, num_stages=3),
    ("plain", 2): SkinnyConfig(4, 2048, num_warps=8, num_stages=3),
    ("full", 1): SkinnyConfig(8, 2048, num_warps=8, num_stages=3),
    ("full", 2): SkinnyConfig(8, 1024, num_warps=8, num_stages=3),
    ("weight_only", 1): SkinnyConfig(16, 2048, num_warps=16, num_stages=3),
}
SKINNY_WIDE_N = 16384
_SKINNY_SM90_WIDE = {("weight_only", 1): SkinnyConfig(16, 1024, num_warps=8, num_stages=3)}
# Untimed GPU starting point (128-bit loads, 4-8 KB of weight per step); the interpreter takes small tiles. num_stages
# is kept for the launch, but Triton 3.6 does not pipeline this loop (no tl.dot: 0 async copies at 1, 3 or 6 stages,
# benchmarks/kernels/compile_report.py): its loads wait in place, and resident programs hide the latency.
_SKINNY_TILES = {"cpu": SkinnyConfig(16, 32, num_warps=4, num_stages=1)}
_SKINNY_GPU_TILE = SkinnyConfig(16, 256, num_warps=4, num_stages=3)
# Split-K counts programs, not waves of one program per SM: a skinny program has one 4-8 KB weight tile in flight
# per stage, and an SM needs ~20 KB in flight to cover HBM latency at its share of 4.3 TB/s (an estimate), so the
# occupancy split aims at this many resident programs per SM, and only grids short of that split at all (a split
# costs a second kernel, the fp32 partials' reduce). At 16x256 tiles o (4096x4096) and down (4096x14336) then get
# split 2 (512 programs instead of 256, one or two per SM), qkv (6144) split 4, gate_up (28672) none.
SKINNY_PROGRAMS_PER_SM = 4


def skinny_config(arch: str, mode: str, m: int, n: int, k: int, num_sms: int) -> SkinnyConfig:
    """The skinny kernel's tile for these sizes, whether or not ``SKINNY_MAX_M`` routes them to it."""
    if mode not in SKINNY_MODES:
        raise ConfigError(f"the skinny GEMM has no mode {mode!r}; expected one of {SKINNY_MODES}")
    if not 1 <= m <= SKINNY_MAX_ROWS:
        raise ConfigError(f"the skinny GEMM takes 1..{SKINNY_MAX_ROWS} rows, got M={m}")
    config = _SKINNY_TILES.get(arch, _SKINNY_GPU_TILE)
    if arch == "sm90":
        config = _SKINNY_SM90.get((mode, m), config)
        if n >= SKINNY_WIDE_N:
            config = _SKINNY_SM90_WIDE.get((mode, m), config)
    if arch == "sm90" and mode != "plain":  # the packed decode is what made sm90 decode tiles fast (see _DECODE_PTX)
        config = replace(config, ptx_decode=True)
    return config if arch == "cpu" else with_skinny_split(config, n, k, num_sms)


def with_skinny_split(config: SkinnyConfig, n: int, k: int, num_sms: int) -> SkinnyConfig:
    """``config`` with the occupancy split-K for an [N, K] weight (``SKINNY_PROGRAMS_PER_SM``)."""
    tiles, slots = -(-n // config.block_n), num_sms * SKINNY_PROGRAMS_PER_SM
    split = _split_for_occupancy(tiles, -(-k // config.block_k), slots) if tiles < slots else 1
    return replace(config, split_k=split)


def choose_skinny(arch: str, mode: str, m: int, n: int, k: int, num_sms: int) -> SkinnyConfig | None:
    """The skinny kernel's config where ``SKINNY_MAX_M`` routes (arch, mode, M) to it, else None."""
    if mode not in SKINNY_MODES and mode not in MODES:
        raise ConfigError(f"unknown GEMM mode {mode!r}")
    if not 1 <= m <= SKINNY_MAX_M.get(arch, {}).get(mode, 0):
        return None
    return skinny_config(arch, mode, m, n, k, num_sms)
