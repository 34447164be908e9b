"""Tile configurations for the nested GEMMs: a small deterministic table per arch, keyed on an M bucket.

No ``triton.autotune`` by default: the interpreter is too slow for it and a deterministic choice keeps CUDA graph
captures reproducible. ``tune_gemm`` (opt-in, GPU only) times a few candidates once per (mode, N, K, M bucket) and
caches the winner in-process.

Reasoning for the sm90 (H200, 132 SMs) rows:
* M <= 64 is weight-bandwidth bound. The weight is operand A (swap-AB) so a 16-wide token tile still feeds a 64-row
  MMA, and a decoded fp16 tile can stay in registers. BLOCK_K is large so each stage moves 16-32 KB of weight bytes
  with 128-bit loads; split-K tops the grid up to fill every SM (o and down projections have few N tiles).
* M >= 256 is compute bound: 128-wide tiles, 8 warps, grouped ordering for L2 reuse of the x tiles.
* FP8 tiles take BLOCK_K = 128 (one wgmma K step of fp8 is 32; 128 keeps 4 stages within shared memory).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, replace

from elastiserve.platforms import ConfigError

M_BUCKETS = (1, 16, 64, 256, 1024, 4096)
MODES = ("full", "weight_only", "fp8")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = True  # weight is operand A: acc is [BLOCK_N, BLOCK_M]
    split_k: int = 1
    group_m: int = 8
    # Decode the weight tile with packed-word PTX (``weight_decode.decode_weight_tile_ptx``), NVIDIA only: the sm90
    # full-mode rows use it (see _DECODE_PTX), the portable decode stays on every other arch.
    ptx_decode: bool = False
    # Registers per thread the compiler may use (PTX .maxnreg), NVIDIA only; None: its own choice. Full mode's
    # grouped tiles take 246-255 registers offline (8 warps per SM); a cap buys resident warps for spills
    # (BENCHMARKS.md, offline compile report). Only probe candidates set it until the H200 has timed them.
    max_registers: int | None = None
    # fp8 and full mode: tiles fetched by TMA from tensor descriptors (``gemm_tma``), sm90. No table row sets it
    # until the H200 has timed it against the pointer kernel (ci/gpu/fp8_tma_round.sh, full_tall_wgmma_round.sh);
    # probe candidates and explicit configs do.
    tma: bool = False

    def __post_init__(self) -> None:
        if self.max_registers is not None and not 24 <= self.max_registers <= 255:
            raise ConfigError(f"GemmConfig.max_registers={self.max_registers}: expected 24-255 or None")
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ConfigError(f"GemmConfig.{name}={value} must be a power of two")
        if min(self.block_m, self.block_n, self.block_k) < 16:
            raise ConfigError(f"tl.dot needs every block dimension >= 16, got {self}")
        if self.split_k < 1 or self.num_stages < 1 or self.group_m < 1:
            raise ConfigError(f"split_k, num_stages and group_m must be >= 1, got {self}")


def m_bucket(m: int) -> int:
    """The smallest bucket >= m (4096 for anything larger)."""
    index = bisect.bisect_left(M_BUCKETS, m)
    return M_BUCKETS[min(index, len(M_BUCKETS) - 1)]


_G = GemmConfig

# Decode rows (M <= 16): of seven tile shapes probed on the H200 (benchmarks/kernels/results/
# h200-gemm-config-probe.json), 64x128 with 6 stages was the best or near it for K = 4096 in every mode (qkv full
# 0.46x / weight-only 0.87x / fp8 1.23x of fp16, against 0.36x / 0.67x / 1.11x for the earlier 64x256), and 128x256
# with 8 warps for K = 14336 (down: weight-only 0.98x, fp8 1.25x). ``DECODE_LONG_K`` holds the latter.
_DECODE = _G(16, 64, 128, num_warps=4, num_stages=6)
DECODE_LONG_K = _G(16, 128, 256, num_warps=8, num_stages=3)
LONG_K = 8192
# Full mode at decode sizes is bound by the in-register decode (~9 integer ops per weight), not by bytes. The
# packed-word PTX decode (four weights per asm call) with narrow 32x256 tiles took qkv from 0.46x to 0.94x and down
# from 0.45x to 0.87x of fp16 at M = 1 (0.86x / 0.85x at M = 16) on the H200, the best of seven tiles for both K
# (benchmarks/kernels/results/h200-gemm-config-probe-run2.json); the portable decode on the same tile: 0.33x / 0.26x.
# The same tile is the weight-only decode row (fast mode on sm90 up to 16 rows until session 16, now where no fp8
# MMA runs; nested_gemm.FP8_MIN_M) for K = 4096
# (qkv M=1 13.2 us = 1.25x fp16); for K >= 8192 weight-only takes 128x128 (down M=1 28.0 us = 1.18x), best of seven
# tiles in h200-gemm-config-probe-run3 (the portable decode's best: 0.87x / 0.91x).
_DECODE_PTX = _G(16, 32, 256, num_warps=4, num_stages=4, ptx_decode=True)
_DECODE_LONG_K_BY_MODE = {"weight_only": _G(16, 128, 128, num_warps=4, num_stages=4, ptx_decode=True),
                          "fp8": DECODE_LONG_K}

_SM90: dict[str, dict[int, GemmConfig]] = {
    "full": {
        1: _DECODE_PTX,
        16: _DECODE_PTX,
        64: _G(64, 64, 128, num_warps=4, num_stages=4, ptx_decode=True),
        256: _G(64, 128, 64, num_warps=4, num_stages=4),
        1024: _G(128, 128, 64, num_warps=8, num_stages=4),
        4096: _G(256, 128, 64, num_warps=8, num_stages=3),
    },
    "weight_only": {
        1: _DECODE_PTX,
        16: _DECODE_PTX,
        64: _G(64, 64, 128, num_warps=4, num_stages=5),
        256: _G(64, 128, 128, num_warps=4, num_stages=4),
        1024: _G(128, 128, 64, num_warps=8, num_stages=4),
        4096: _G(256, 128, 64, num_warps=8, num_stages=3),
    },
    "fp8": {
        1: _DECODE,
        16: _DECODE,
        64: _G(64, 64, 256, num_warps=4, num_stages=4),
        256: _G(64, 128, 128, num_warps=4, num_stages=4, swap_ab=False),
        1024: _G(128, 128, 128, num_warps=8, num_stages=4, swap_ab=False),
        4096: _G(128, 256, 128, num_warps=8, num_stages=3, swap_ab=False),
    },
}

# fp8 on sm90 from 17 rows (fast mode's rows; nested_gemm.FP8_MIN_M): (most rows, tile up to N = 8192, tile for wider
# N such as gate_up). From the H200 tile probe of session 16 (benchmarks/kernels/probe_fp8_tiles.py, raw
# benchmarks/kernels/results/h200-fp8-tiles-s16.json; 11 tiles x split-K on the four Llama-3.1-8B linears, every time
# with the quantizer): the bucketed rows above were 1.22-1.25x slower than each shape's best tile at 32-128 rows,
# mostly from the occupancy split-K at K = 4096 (qkv at 64 rows: 18.3 us split 4, 12.1 us unsplit) and gate_up's
# narrow tiles (64 rows: 52.5 -> 36.2 us). These rows are 1.00-1.15x of the per-shape best at every probed M.
# The 16-row decode row (2-16 rows; one row is weight-only, nested_gemm.FP8_MIN_M) from session 17's probe of eight
# 16-row tiles (probe_fp8_tiles.py --m 2 4 8 16, benchmarks/kernels/results/h200-fp8-decode-tiles-s17.json, quantizer
# included): 16x64x512 is within 0.2 % of the best tile on qkv, o and down at every M, 16x128x256 within 0.6 % on
# gate_up, against the bucketed 16x64x128 (6 stages, occupancy split) that ran 4-15 % slower (qkv 12.5 -> 11.2 us,
# gate_up 37.2 -> 33.3 us at 2 rows). Split-K only from K = 8192, at the occupancy split with >= 4 K blocks a split
# (down: 23.1 us split 2; o at K = 4096 lost 3 % split).
_FP8_SM90_ROWS = (
    (16, _G(16, 64, 512, num_warps=4, num_stages=3), _G(16, 128, 256, num_warps=4, num_stages=3)),
    (32, _G(32, 64, 256, num_warps=4, num_stages=4), _G(32, 64, 256, num_warps=4, num_stages=4)),
    (64, _G(64, 64, 256, num_warps=4, num_stages=4), _G(64, 128, 128, num_warps=4, num_stages=4, swap_ab=False)),
    (128, _G(64, 64, 256, num_warps=4, num_stages=4), _G(128, 256, 128, num_warps=8, num_stages=3, swap_ab=False)),
    (256, _G(128, 128, 128, num_warps=8, num_stages=4, swap_ab=False),
     _G(128, 256, 128, num_warps=8, num_stages=3, swap_ab=False)),
    (512, _G(128, 128, 128, num_warps=8, num_stages=4, swap_ab=False),
     _G(128, 128, 128, num_warps=8, num_stages=4, swap_ab=False)),
)
_FP8_SM90_LARGE = _G(128, 256, 128, num_warps=8, num_stages=3, swap_ab=False)
FP8_WIDE_N = 8192
# Split-K pays for its fp32 partials and reduce launch only on long K: the down projection (K = 14336) at 32-64 rows
# ran 24.6 / 25.7 us split in two against 27.8 / 28.8 unsplit; at K = 4096 no split won.
FP8_SPLIT_MIN_K, FP8_SPLIT_MIN_K_BLOCKS = LONG_K, 16
FP8_DECODE_SPLIT_MIN_K_BLOCKS = 4  # the decode row's 512-wide K blocks: K = 14336 has 28


def _fp8_sm90_config(m: int, n: int, k: int, num_sms: int) -> GemmConfig:
    config = next((wide if n > FP8_WIDE_N else narrow for top, narrow, wide in _FP8_SM90_ROWS if m <= top),
                  _FP8_SM90_LARGE)
    if k >= FP8_SPLIT_MIN_K:
        tiles = -(-m // config.block_m) * -(-n // config.block_n)
        min_blocks = FP8_DECODE_SPLIT_MIN_K_BLOCKS if m <= 16 else FP8_SPLIT_MIN_K_BLOCKS
        split = _split_for_occupancy(tiles, -(-k // config.block_k), num_sms, min_blocks=min_blocks)
        if split > 1:
            config = replace(config, split_k=split)
    return config


# A100-class: no wgmma, 164 KB shared memory; same shapes with fewer stages. The PTX decode is sm90-timed only.
_SM80 = {mode: {b: replace(c, num_stages=min(c.num_stages, 3), ptx_decode=False) for b, c in table.items()}
         for mode, table in _SM90.items()}

# AMD: at most 16 warps, 64 KB LDS per CU; 2 stages are what the AMD pipeliner uses; no PTX.
_GFX = {mode: {b: replace(c, num_stages=2, block_k=min(c.block_k, 128), ptx_decode=False) for b, c in table.items()}
        for mode, table in _SM90.items()}

# Interpreter: small tiles keep the numpy work per program tiny.
_CPU = {mode: {b: _G(16, 32, 32, num_warps=4, num_stages=1) for b in M_BUCKETS} for mode in MODES}

TABLES: dict[str, dict[str, dict[int, GemmConfig]]] = {
    "sm90": _SM90, "sm89": _SM80, "sm80": _SM80, "gfx942": _GFX, "gfx950": _GFX, "cpu": _CPU,
}

# Full mode from this many rows decodes the weight once (``merge_planes``) and runs the vendor fp16 GEMM: the fused
# kernel repeats the decode per row tile and measured 0.12-0.17x of cuBLAS at M = 256 and 0.19-0.38x above on the
# H200 (h200-nested-gemm-run1), against 0.45-0.52x at M = 64 where one pass over the weight dominates anyway.
# The interpreter keeps the fused kernel at every M so the CPU tests exercise it.
# sm90 from 65 rows: at 96 and 127 rows the materialized path took 41.4 / 30.9 / 178.0 / 95.5 us (qkv / o / gate_up /
# down) against the fused kernel's best tile 49.4 / 32.6 / 192.7 / 103.7 us and the bucketed tile's 111.5-390.8 us;
# at 64 rows the fused kernel still won (32.8 vs 40.1 us on qkv). Session 16's full-mode probe
# (benchmarks/kernels/results/h200-full-tiles-s16.json). With FULL_SM90_TALL_ON, sm90 from 257 rows (see below).
MATERIALIZE_MIN_M = {"sm90": 65, "sm89": 128, "sm80": 128, "gfx942": 128, "gfx950": 128}
# sm90 full mode at 17-32 rows: the PTX decode tile with a 32-row token tile and no split-K ran 20.5-20.9 / 15.1-15.6 /
# 69.9-71.0 / 45.0-46.5 us on the four Llama-3.1-8B linears, against 30.7-33.7 / 22.8-23.0 / 112.2-123.9 / 67.3-68.6 us
# for the bucket-64 tile (same probe): 0.71-0.94x of cuBLAS fp16 instead of 0.48-0.60x.
FULL_SM90_ROWS_32 = _G(32, 32, 256, num_warps=4, num_stages=4, ptx_decode=True)
# sm90 full mode at 65-256 rows (33-256 on some classes, below): tall token tiles fetched by TMA (gemm_tma), the decoded
# weight wgmma's register operand A. H100 probe, session 32 (probe_fp8_tiles.py --mode full --tall-only --tma, raw
# benchmarks/kernels/results/h100-full-tall-wgmma-s32.json; Llama-3.1-8B linears at 96 / 128 / 192 / 256 rows): per row
# range and weight class the tile with the best geomean, at the split it was timed with. Against cuBLAS fp16 it ran
# 0.60-0.66x (qkv), 0.66-0.68x (o), 0.89-0.98x (gate_up), 0.78-0.86x (down) up to 128 rows and 0.45-0.75x above, where
# the materialized path these rows took before ran 0.37-0.46x on every shape. Classes: "wide" N > FP8_WIDE_N (gate_up),
# "long_k" K >= LONG_K (down), "mid" N > 4096 (qkv), "narrow" (o). On since session 33: on an H100 every tile of the
# table gave the pointer kernel's bits and the op matched the reference at 65-300 rows with them (test_gemm_tma.py,
# test_nested_gemm.py, test_merge_planes.py: 50 passed), and the GEMM table through the op ran qkv 0.64 / 0.65 / 0.45 /
# 0.47x and down 0.82 / 0.82 / 0.61 / 0.66x cuBLAS fp16 at 96 / 128 / 192 / 256 rows
# (benchmarks/kernels/results/h100-gemm-tall-rows-s33.json). Off, 65-256 rows take the materialized weight again and
# 33-64 rows session 16's pointer tiles.
FULL_SM90_TALL_ON = True
FULL_TMA_MAX_M = 256
FULL_WEIGHT_CLASSES = ("wide", "long_k", "mid", "narrow")
# The first row count each weight class takes the TMA tiles at; below it, down to 33, session 16's pointer tiles.
# Session 34 (H100, bench_nested_gemm.py --m 33 48 64 with and without --full-tall-min-rows 33; raw
# benchmarks/kernels/results/h100-gemm-tall-from-33-s34.json) moved qkv and gate_up to the tall tiles from 33 rows
# (31.5 / 34.2 / 30.8 against 38.3 / 37.4 / 38.3 us on qkv at 33 / 48 / 64 rows); session 36's shared-operand tiles
# (below) beat the pointer tiles on o and down there too (o 17.6 / 18.8 against 22.3 / 22.0 us at 40 / 64 rows).
FULL_TMA_MIN_M_BY_CLASS = dict.fromkeys(FULL_WEIGHT_CLASSES, 33)


def _tall(block_m, block_n, block_k, warps, split_k=1):  # the decoded weight is wgmma's register operand A
    return _G(block_m, block_n, block_k, num_warps=warps, num_stages=3, split_k=split_k, ptx_decode=True, tma=True)


def _smem_b(block_m, warps, stages, split_k=1, block_n=128):  # decoded weight: wgmma's shared operand B; tokens: A
    return _G(block_m, block_n, 64, num_warps=warps, num_stages=stages, split_k=split_k, swap_ab=False,
              ptx_decode=True, tma=True)


# Full mode's TMA tile per row bucket (33-64, 65-128, 129-256 rows) and weight class. Two operand roles:
# * register A (session 32): the weight decoded into wgmma's A fragment, two bytes at a time (32 two-byte shared loads
#   and 128 byte permutes a K step, 339 SASS instructions on 128x64x64);
# * shared B (session 36, probe_fp8_tiles.py --smem-b): tokens are operand A straight from their TMA tile, the decoded
#   weight is stored to shared memory with 16-byte stores as operand B (185-255 SASS instructions a K step;
#   compile_report.full_tma_report prints every tile's).
# H100, session 36 (raw benchmarks/kernels/results/h100-full-smem-b-tiles-s36*.json; us per call against the table
# of the time, at 40 / 64 / 96 / 128 / 192 / 256 rows): shared B wins at every row on gate_up (88.4 / 88.6 / 89.9 /
# 90.5 / 136.7 / 142.3 against 115.6 / 104.4 / 100.3 / 101.1 / 155.9 / 157.1; 1.09x cuBLAS fp16 at 40-64 rows) and
# down (49.7 / 50.9 / 56.7 / 58.8 / 79.2 / 84.4 against 68.0 / 66.3 / 64.3 / 63.8 / 82.9 / 88.2), on o at 40-64
# rows only (17.6 / 18.8 against 22.3 / 22.0; 21.5 against 22.1 at 96 and a tie at 192 keep the tall tiles), and
# on qkv at no row range (34.7 against 30.6 at 64; 51.3 against 50.1 at 192). Session 37 (probe --smem-b with
# narrower weight tiles; raw benchmarks/kernels/results/{h100,h200}-full-smem-b-qkv-o-s37.json): on the H100 at 40 /
# 64 / 128 / 256 rows, 64 weight rows a tile at 6 stages (two CTAs a SM) take qkv at 33-64 (28.2 / 28.3 against
# 31.2 / 31.0), 128x64 qkv at 129-256 (45.6 against 51.2 at 256) and o at 65-128 (21.3 against 22.6), 128x128 o at
# 129-256 (32.8 against 34.3); qkv at 65-128 keeps the register-A tile (34.6 against 33.2). The H200 (64 / 256 rows)
# agreed at 256 (qkv 45.4, o 32.6: best of the family) and kept o's session-36 tile at 33-64 (16.3 against 17.5 for
# 64x64, which the H100 preferred by 2-8 %: the issue's GPU decides). The other register-A rows are session 32's.
FULL_SM90_TMA = {
    64: {"wide": _smem_b(64, 4, 4), "long_k": _smem_b(64, 4, 4, split_k=4), "mid": _smem_b(64, 4, 6, block_n=64),
         "narrow": _smem_b(64, 4, 4, split_k=4)},
    128: {"wide": _smem_b(128, 8, 3), "long_k": _smem_b(128, 8, 4, split_k=4), "mid": _tall(128, 64, 64, 4, split_k=4),
          "narrow": _smem_b(128, 4, 5, split_k=2, block_n=64)},
    256: {"wide": _smem_b(256, 8, 3), "long_k": _smem_b(256, 8, 3, split_k=4), "mid": _smem_b(128, 4, 4, block_n=64),
          "narrow": _smem_b(128, 8, 4, split_k=2)},
}


def full_tma_tile(m: int, n: int, k: int) -> GemmConfig:
    """FULL_SM90_TMA's entry for ``m`` rows (33-256) of an [N, K] weight, before the short-K split cut."""
    return FULL_SM90_TMA[64 if m <= 64 else 128 if m <= 128 else 256][full_weight_class(n, k)]


def full_weight_class(n: int, k: int) -> str:
    """FULL_SM90_TMA's class of an [N, K] weight: N > FP8_WIDE_N (gate_up), K >= LONG_K (down), N > 4096 (qkv)."""
    return "wide" if n > FP8_WIDE_N else "long_k" if k >= LONG_K else "mid" if n > 4096 else "narrow"


def full_takes_tma(arch: str, m: int, n: int, k: int) -> bool:
    """Whether full mode at ``m`` rows on an [N, K] weight runs FULL_SM90_TMA's tiles (when the tensors suit TMA)."""
    min_m = max(33, FULL_TMA_MIN_M_BY_CLASS[full_weight_class(n, k)])  # <= 32 rows: FULL_SM90_ROWS_32
    return FULL_SM90_TALL_ON and arch == "sm90" and min_m <= m <= FULL_TMA_MAX_M


def _full_sm90_tma(m: int, n: int, k: int) -> GemmConfig:
    config = full_tma_tile(m, n, k)
    while config.split_k > 1 and -(-k // config.block_k) < 4 * config.split_k:  # short K: >= 4 K blocks a split
        config = replace(config, split_k=config.split_k // 2)
    return config


def materializes_full(arch: str, m: int, n: int, k: int) -> bool:
    """Whether full mode at ``m`` rows on an [N, K] weight decodes it once and runs the vendor GEMM."""
    threshold = MATERIALIZE_MIN_M.get(arch)
    return threshold is not None and m >= threshold and not full_takes_tma(arch, m, n, k)


# ---- grouped (MoE) GEMM: nested_moe.py ------------------------------------------------------------------------------

GROUPED_MODES = ("plain", *MODES)  # plain: unnested fp16 experts (the static-fp16 engine's grouped GEMM)
# sm90 tiles from 64 rows per expert up, from the H200 probe (benchmarks/kernels/probe_moe_configs.py, raw
# benchmarks/kernels/results/h200-moe-probe-run1/; Qwen3-30B-A3B experts, gate_up + down per layer, 13 tiles per
# mode). The dense tables' rows were the grouped kernel's until then, and from 64 rows per expert their full-mode
# tile has the portable decode and BLOCK_M = 64: 2,048 tokens (128 rows per expert) took 1,995 us per layer in full
# mode against 1,154 us on 128x128x128 with the PTX decode, and 4,096 tokens 3,415 against 1,847 us (plain fp16:
# 750 -> 639 and 1,174 -> 971 us; fp8: 481 -> 457 and 792 -> 725 us). 128x128x128 was best at 64 and 128 rows per
# expert in full mode and within 3 % of 256x128x64 at 256; bucket 1024 and 4096 (more than 4,096 tokens) take the
# 4,096-token winners, not probed above that. Buckets 1 and 16 keep the dense rows (16,32,256 PTX was the best full
# tile at 256 tokens as well; 64 tokens and fewer were not probed).
_GROUPED_PREFILL_SM90 = {
    "plain": {64: _G(128, 128, 64, num_warps=8, num_stages=3), 256: _G(128, 256, 64, num_warps=8, num_stages=3)},
    "full": {64: _G(128, 128, 128, num_warps=8, num_stages=3, ptx_decode=True),
             256: _G(128, 128, 128, num_warps=8, num_stages=3, ptx_decode=True),
             1024: _G(256, 128, 64, num_warps=8, num_stages=3, ptx_decode=True)},
    "fp8": {64: _G(128, 128, 128, num_warps=8, num_stages=3), 256: _G(128, 128, 128, num_warps=8, num_stages=3)},
}


def choose_grouped_config(arch: str, mode: str, rows_per_expert: int, n: int, k: int, num_sms: int) -> GemmConfig:
    """Tile of the grouped MoE kernel for experts that see ``rows_per_expert`` rows each (about T * top_k / E)."""
    if mode not in GROUPED_MODES:
        raise ConfigError(f"unknown grouped GEMM mode {mode!r}; expected one of {GROUPED_MODES}")
    bucket = m_bucket(rows_per_expert)
    table = _GROUPED_PREFILL_SM90.get(mode, {}) if arch == "sm90" else {}
    chosen = [table[b] for b in sorted(table) if b <= bucket]
    if chosen:
        return chosen[-1]
    # Elsewhere full mode's dense rows (two weight bytes per element), without the decode for plain experts.
    config = choose_config(arch, "full" if mode == "plain" else mode, rows_per_expert, n, k, num_sms, grouped=True)
    return replace(config, split_k=1, ptx_decode=False) if mode == "plain" else replace(config, split_k=1)


_tuned: dict[tuple[str, str, int, int, int], GemmConfig] = {}


def _split_for_occupancy(tiles: int, k_blocks: int, num_sms: int, max_split: int = 8, min_blocks: int = 4) -> int:
    """Smallest split-K that best fills whole waves, keeping >= ``min_blocks`` K blocks per split."""
    best, best_eff = 1, tiles / (-(-tiles // num_sms) * num_sms)
    for split in range(2, max_split + 1):
        if k_blocks < min_blocks * split:
            break
        total = tiles * split
        eff = total / (-(-total // num_sms) * num_sms)
        if eff > best_eff + 0.05:
            best, best_eff = split, eff
    return best


def choose_config(arch: str, mode: str, m: int, n: int, k: int, num_sms: int, *, grouped: bool = False) -> GemmConfig:
    """Deterministic tile choice for y[m, n] = x[m, k] @ W[n, k].T in ``mode``.

    ``grouped``: the MoE kernel's fallback, which keeps sm90's bucketed fp8 rows at <= 16 rows (the dense decode row
    of ``_FP8_SM90_ROWS`` was probed on dense shapes only)."""
    if mode not in MODES:
        raise ConfigError(f"unknown GEMM mode {mode!r}; expected one of {MODES}")
    bucket = m_bucket(m)
    tuned = _tuned.get((arch, mode, n, k, bucket))
    if tuned is not None:
        return tuned
    if arch == "sm90" and mode == "fp8" and not (grouped and m <= 16):
        return _fp8_sm90_config(m, n, k, num_sms)
    if arch == "sm90" and mode == "full" and 16 < m <= 32:
        return FULL_SM90_ROWS_32
    if mode == "full" and full_takes_tma(arch, m, n, k) and not grouped:
        return _full_sm90_tma(m, n, k)
    config = TABLES.get(arch, _SM80)[mode][bucket]
    if arch == "sm90" and bucket <= 16 and k >= LONG_K and mode in _DECODE_LONG_K_BY_MODE:  # sm90 smem only
        config = _DECODE_LONG_K_BY_MODE[mode]
    if arch != "cpu" and bucket <= 64:
        tiles = -(-m // config.block_m) * -(-n // config.block_n)
        split = _split_for_occupancy(tiles, -(-k // config.block_k), num_sms)
        if split > 1:
            config = replace(config, split_k=split)
    return config


def candidate_configs(mode: str, m: int) -> list[GemmConfig]:
    """A handful of alternatives around the table entry, for the opt-in tuner."""
    base = _SM90[mode][m_bucket(m)]
    out = [base]
    for block_n in (32, 64, 128, 256):
        for block_k in (64, 128, 256):
            for stages in (3, 4, 5):
                for swap_ab in (True, False):
                    cand = replace(base, block_n=block_n, block_k=block_k, num_stages=stages, swap_ab=swap_ab)
                    if cand not in out and block_n * block_k <= 32768 and _smem_bytes(mode, cand) <= 200_000:
                        out.append(cand)
    return out


def _smem_bytes(mode: str, config: GemmConfig) -> int:
    """Pipeline buffers only: weight planes (1 or 2 bytes per element) plus the x tile (2, or 1 for fp8)."""
    weight = config.block_n * config.block_k * (2 if mode == "full" else 1)
    x = config.block_m * config.block_k * (1 if mode == "fp8" else 2)
    return (weight + x) * config.num_stages


def remember_tuned(arch: str, mode: str, n: int, k: int, m: int, config: GemmConfig) -> None:
    _tuned[(arch, mode, n, k, m_bucket(m))] = config


def tune(arch: str, mode: str, n: int, k: int, m: int, time_fn) -> GemmConfig:
    """Opt-in tuner (GPU only): ``time_fn(config) -> seconds`` for each candidate; the winner is cached for
    (arch, mode, N, K, M bucket) and returned by ``choose_config`` from then on. Failing candidates are skipped."""
    candidates = candidate_configs(mode, m)
    if m_bucket(m) <= 64:
        candidates += [replace(c, split_k=s) for c in candidates[:12] for s in (2, 4)]
    best, best_time = None, float("inf")
    for config in candidates:
        try:
            seconds = time_fn(config)
        except Exception as exc:  # a candidate that does not compile or fit in shared memory on this GPU
            log.debug("tuning %s N=%d K=%d M=%d: %s failed: %s", mode, n, k, m, config, exc)
            continue
        if seconds < best_time:
            best, best_time = config, seconds
    if best is None:
        raise ConfigError(f"no candidate config ran for {mode} N={n} K={k} M={m}")
    remember_tuned(arch, mode, n, k, m, best)
    return best
