"""One-shot GPU probe: fast mode's fp8 GEMM tiles from 2 to 4,096 rows (or full mode's fused tiles below the rows
where it materializes), against the vendor GEMMs and the table's tile.

Per (shape, M): cuBLAS fp16 and ``_scaled_mm`` on pre-quantized per-tensor operands (the vendor's best case), the
per-token quantizer alone, the tile ``configs.choose_config`` picks today, and each candidate tile with split-K 1 and
with the split that fills whole waves (``configs._split_for_occupancy``). Every time includes the quantizer, as a
model's call does. ``--mode full``: the fused full-mode kernel's tiles with the packed PTX decode (M below
``configs.MATERIALIZE_MIN_M``), beside cuBLAS fp16 and the materialized path (``full_via_merged_weight``).
CUDA-graph replay over weight copies past the L2 (the kernel benchmark's method).

    python benchmarks/kernels/probe_fp8_tiles.py --out fp8_tiles.json [--shapes qkv down] [--m 64 256] [--mode full]
    python benchmarks/kernels/probe_fp8_tiles.py --out fp8_decode.json --m 2 4 8 16   # the decode tiles
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nested_gemm import SHAPES, copies_for, graph_time_us, make_weights

from elastiserve.kernels import configs, fp8_activations, gemm_tma, nested_gemm
from elastiserve.kernels.formats import Nesting
from elastiserve.platforms import current_platform

G = configs.GemmConfig
CANDIDATES = [  # block_m, block_n, block_k, warps, stages, swap_ab
    (16, 64, 128, 4, 6, True), (32, 64, 256, 4, 4, True), (64, 64, 256, 4, 4, True), (32, 128, 128, 4, 4, True),
    (64, 128, 128, 4, 4, True), (64, 128, 128, 4, 4, False), (64, 256, 128, 8, 3, False),
    (128, 128, 128, 4, 4, False), (128, 128, 128, 8, 4, False), (128, 256, 128, 8, 3, False),
    (256, 128, 128, 8, 3, False),
]
# Decode sizes (2-16 rows, fp8 since session 16's FP8_MIN_M): 16-row token tiles only, weight tiles of 4-32 KB.
DECODE_CANDIDATES = [
    (16, 32, 256, 4, 4, True), (16, 64, 256, 4, 4, True), (16, 128, 128, 4, 4, True), (16, 128, 128, 8, 4, True),
    (16, 128, 256, 4, 3, True), (16, 256, 128, 8, 3, True), (16, 64, 512, 4, 3, True), (16, 128, 256, 8, 3, True),
]
M_DEFAULT = (32, 64, 128, 256, 512, 1024, 2048, 4096)
FULL_CANDIDATES = [  # block_m, block_n, block_k, warps, stages (swap-AB, PTX decode)
    (16, 32, 256, 4, 4), (32, 32, 256, 4, 4), (64, 32, 256, 4, 4), (32, 64, 128, 4, 4), (64, 64, 128, 4, 4),
    (32, 64, 256, 4, 3), (64, 64, 256, 4, 3), (32, 128, 128, 8, 3), (64, 128, 128, 8, 3),
]
# Tall token tiles on a 32-wide weight tile (session 18): a 32-row weight tile cannot feed wgmma (64 rows per
# warpgroup), so these run mma.sync with the decoded tile as operand A in registers, and one token tile up to 256 rows
# decodes each weight once (session 16's 32x32x256 decoded it twice at 64 rows: 32.8 against 20.9 us at 32 on qkv).
FULL_TALL_CANDIDATES = [
    (128, 32, 128, 4, 4), (128, 32, 256, 4, 3), (256, 32, 128, 4, 3), (128, 32, 128, 8, 4), (256, 32, 128, 8, 3),
    (256, 32, 64, 8, 4), (128, 16, 256, 4, 4),
]
# Tall token tiles on 64-128 weight rows (session 28): a weight tile of 64 rows a warpgroup feeds wgmma with the
# decoded tile as register operand A, and a 128-256-row token tile decodes each weight once up to 256 rows. Compiled
# for sm90 on the CPU (compile_report.compile_gemm): every one runs async wgmma (wait_group 1-3), no spills, 131-254
# registers; never timed (session 18's tall tiles were 32 or 16 weight rows, on mma.sync).
FULL_WGMMA_TALL_CANDIDATES = [
    (128, 64, 64, 4, 3), (128, 64, 128, 4, 3), (256, 64, 64, 4, 3), (256, 64, 64, 8, 3), (128, 128, 64, 8, 3),
    (256, 128, 64, 8, 3), (256, 128, 32, 8, 4),
]
# Tall tiles on 256 weight rows (session 34, ``--wide-only``, TMA only): the shipped tall tiles move 4.0-5.4 TB/s
# from L2 into the SMs counting each 64- or 128-row weight tile's re-read of its token tile (H100, session 34's table
# at 128 and 256 rows), below the 7.6-8.4 TB/s our fp8 GEMM moves at 1,024 rows by the same count: not the bytes but
# the latency of each K step bounds them, and a wider weight tile runs 2-4x the MMAs per token tile fetched.
# Compiled for sm90 offline (Triton 3.6): 128x256x64 at 8 warps 194 registers, 115 KB shared, no spills; 128x256x32
# at 4 stages 174; 64x256x64 122.
FULL_WIDE_TALL_CANDIDATES = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 2), (128, 256, 32, 8, 4), (64, 256, 64, 8, 3)]
# Full mode with the decoded weight stored to shared memory as wgmma's operand B (session 36, ``--smem-b``, TMA
# only): tokens are operand A straight from the TMA tile, so each thread reads its weight bytes with LDS.128 (the
# register-A tall tiles read two bytes at a time to fill wgmma's A fragment: 32 LDS.U16 and 128 PRMT a K step) and
# stores the fp16 tile with STS.128. Compiled for sm90 offline (Triton 3.6), the K loop's SASS is 185-255
# instructions (compile_report.full_tma_report) against 339 on the 128x64x64 register-A tile; the
# loop waits for its wgmma each K step (one decoded buffer), so the overlap comes from 2-3 CTAs a SM. Registers
# 100-187, shared 98-148 KB, no spills. H100, session 36: the first seven won on gate_up and down at 40-256 rows and
# on o at 40-64 (configs.FULL_SM90_TMA); qkv lost at 40-128 rows. The last three, added after that run for qkv- and
# o-like weights (more, narrower weight tiles: 64x64x64 at 6 stages is 183 instructions, 68 registers, 96 KB, two
# CTAs a SM), won on qkv at 40-64 and 256 rows and o at 128-256 in session 37 (configs.FULL_SM90_TMA says where).
FULL_SMEM_B_CANDIDATES = [(64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
                          (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 2),
                          (64, 64, 64, 4, 6), (128, 64, 64, 4, 5), (64, 256, 64, 8, 3)]
# The same operand roles in Gluon (gemm_full_gluon, ``--gluon``): two decoded buffers so that the decode of the next
# K step overlaps the wgmma in flight. Offline (sm90): 203 / 205 / 219 SASS instructions a K step on 128x128x64 (8
# warps) / 128x64x64 (4) / 256x128x64 (8); shared 115-213 KB, so 2 stages where 3 leave one CTA a SM.
FULL_GLUON_CANDIDATES = [(128, 128, 64, 8, 2), (128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (128, 64, 64, 4, 4),
                         (64, 128, 64, 4, 3), (128, 256, 64, 8, 2), (256, 128, 64, 8, 2)]
# The producer / consumer Gluon kernel (``--gluon-ws``: a TMA warp, a 4-warp decode partition, the MMA warps; written
# after session 36's ncu run found the K loops short of warps free of decode work). Offline (sm90): 168 registers at
# launch, so one CTA a SM; 115-181 KB of shared memory. H100, session 37: 2-31 % slower than the op's route at
# 64-128 rows, ahead only on qkv / o at 256, 0.64-0.68x cuBLAS at 4,096 rows (BENCHMARKS.md, kernels).
FULL_GLUON_WS_CANDIDATES = [(128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
                            (256, 128, 64, 8, 3)]
# Full mode's tile families with tokens as operand A (swap_ab=False, TMA only), by --family: Triton's tiles timed
# through nested_gemm, the Gluon kernels' through time_gluon.
SHARED_B_FAMILIES = {"smem-b": FULL_SMEM_B_CANDIDATES, "gluon": FULL_GLUON_CANDIDATES,
                     "gluon-ws": FULL_GLUON_WS_CANDIDATES}
FULL_M_DEFAULT = (17, 32, 48, 64, 96, 127)


def candidates_for(m: int, n: int, k: int, mode: str = "fp8", tall_only: bool = False,
                   tma: bool = False, wide_only: bool = False, family: str | None = None) -> list[configs.GemmConfig]:
    """Each candidate whose token tile is not far larger than M, at split-K 1 and at the occupancy split
    (``tall_only``: full mode's tall token tiles alone; ``tma``: each tile also fetched by TMA, where it fits;
    ``wide_only``: full mode's 256-weight-row tall tiles alone, by TMA only; ``family``: one of SHARED_B_FAMILIES,
    full mode's tiles with the decoded weight as wgmma's shared operand B, by TMA only)."""
    out = []
    if mode == "full" and family:
        tiles = [G(bm, bn, bk, num_warps=w, num_stages=s, ptx_decode=True, swap_ab=False)
                 for bm, bn, bk, w, s in SHARED_B_FAMILIES[family]]
    elif mode == "full":
        tall = FULL_TALL_CANDIDATES + FULL_WGMMA_TALL_CANDIDATES if m > 32 else []
        rows = FULL_WIDE_TALL_CANDIDATES if wide_only else tall if tall_only else FULL_CANDIDATES + tall
        tiles = [G(bm, bn, bk, num_warps=w, num_stages=s, ptx_decode=True) for bm, bn, bk, w, s in rows]
    else:
        rows = CANDIDATES + DECODE_CANDIDATES if m <= 16 else CANDIDATES
        tiles = [G(bm, bn, bk, num_warps=w, num_stages=s, swap_ab=swap) for bm, bn, bk, w, s, swap in rows]
    for config in tiles:
        bm, bn = config.block_m, config.block_n
        too_tall = bm > (16 if m <= 16 else max(32, 2 * m))
        if too_tall or (m >= 1024 and bm < 64) or (mode == "full" and not family and bm < 16 * -(-m // 64)):
            continue
        n_tiles = -(-m // bm) * -(-n // bn)
        split = configs._split_for_occupancy(n_tiles, -(-k // config.block_k), current_platform().num_sms)
        variants = [config] + ([replace(config, split_k=split)] if split > 1 else [])
        if wide_only or family:
            out += [replace(v, tma=True) for v in variants]
            continue
        out += variants
        if tma and max(bm, bn, config.block_k) <= gemm_tma.TMA_MAX_BOX:
            out += [replace(v, tma=True) for v in variants]
    return out


def time_mode(x, weights, config, mode: str = "fp8") -> float:
    return graph_time_us([lambda c=c: nested_gemm.nested_gemm(x, c["upper"], c["lower"], None, Nesting.E4M3, mode,
                                                               config=config) for c in weights])


def time_gluon(x, weights, config, warp_specialized: bool = False) -> tuple[float, float]:
    """A Gluon kernel at ``config``: microseconds per call, and its largest error on the first weight against
    cuBLAS fp16 relative to the output's largest magnitude (an exact weight: fp16 GEMM rounding, ~1e-3)."""
    from elastiserve.kernels.gemm_full_gluon import launch_full_gluon

    def call(c):
        return launch_full_gluon(x, c["upper"], c["lower"], int(Nesting.E4M3), config.block_m, config.block_n,
                                 config.block_k, config.num_stages, config.num_warps, config.split_k,
                                 warp_specialized=warp_specialized)

    dense = (x @ weights[0]["w"].t()).float()
    err = float((call(weights[0]).float() - dense).abs().max() / dense.abs().max())
    return graph_time_us([lambda c=c: call(c) for c in weights]), err


def time_baselines(x, weights, mode: str) -> dict[str, float]:
    if mode == "full":
        return {
            "torch_fp16": graph_time_us([lambda c=c: torch.matmul(x, c["w"].t()) for c in weights]),
            "merged_full": graph_time_us([lambda c=c: nested_gemm.full_via_merged_weight(
                x, c["upper"], c["lower"], None, Nesting.E4M3) for c in weights]),
            "table": time_mode(x, weights, None, "full"),
        }
    x_scale = (x.abs().max().float() / 448).reshape(())
    x8 = (x.float() / x_scale).to(torch.float8_e4m3fn)
    return {
        "torch_fp16": graph_time_us([lambda c=c: torch.matmul(x, c["w"].t()) for c in weights]),
        "scaled_mm_pertensor": graph_time_us([lambda c=c: torch._scaled_mm(
            x8, c["w8t"], scale_a=x_scale, scale_b=c["w_scale"], out_dtype=torch.float16) for c in weights]),
        "quantize_per_token": graph_time_us([lambda: fp8_activations.quantize_per_token(x)] * len(weights)),
        "table": time_mode(x, weights, None),
    }


def probe_shape(name: str, n: int, k: int, m_values, out: list, mode: str, tall_only: bool = False,
                tma: bool = False, wide_only: bool = False, family: str | None = None) -> None:
    weights = make_weights(n, k, copies_for(n * k * 2))
    platform = current_platform()
    for m in m_values:
        x = torch.randn(m, k, device="cuda").half()
        row = {"shape": name, "N": n, "K": k, "M": m, "mode": mode, "us": time_baselines(x, weights, mode),
               "table_config": asdict(configs.choose_config(platform.arch, mode, m, n, k, platform.num_sms)),
               "candidates": []}
        gluon = family in ("gluon", "gluon-ws")
        for config in candidates_for(m, n, k, mode, tall_only, tma, wide_only, family):
            try:
                us, err = (time_gluon(x, weights, config, family == "gluon-ws") if gluon
                           else (time_mode(x, weights, config, mode), None))
            except Exception as exc:  # out of shared memory, say: recorded, not timed
                row["candidates"].append({"config": asdict(config), "error": str(exc)[:200]})
                continue
            row["candidates"].append({"config": asdict(config), "us": us}
                                     | ({"rel_err": err} if err is not None else {}))
            if err is not None:
                print(f"{'':20s} M={m:5d} {family} {config.block_m}x{config.block_n}x{config.block_k} "
                      f"w{config.num_warps} s{config.num_stages} split{config.split_k}: {us:7.1f} us, "
                      f"rel. error {err:.1e}", flush=True)
        timed = [c for c in row["candidates"] if "us" in c]
        best = min(timed, key=lambda c: c["us"])
        row["best"] = best
        us = row["us"]
        cfg = best["config"]
        vendor = (f"merged {us['merged_full']:7.1f}" if mode == "full" else
                  f"scaled_mm {us['scaled_mm_pertensor']:7.1f} quant {us['quantize_per_token']:5.1f}")
        print(f"{name:20s} M={m:5d} fp16 {us['torch_fp16']:7.1f} {vendor} "
              f"table {us['table']:7.1f} ({us['torch_fp16'] / us['table']:.2f}x) "
              f"best {best['us']:7.1f} ({us['torch_fp16'] / best['us']:.2f}x) {cfg['block_m']}x{cfg['block_n']}x"
              f"{cfg['block_k']} w{cfg['num_warps']} s{cfg['num_stages']} swap{int(cfg['swap_ab'])} "
              f"split{cfg['split_k']} tma{int(cfg['tma'])}", flush=True)
        if tma:  # the best of each fetch side by side: what TMA changes at this shape and M
            for fetch in ("pointer", "tma"):
                same = [c for c in timed if c["config"]["tma"] == (fetch == "tma")]
                row[f"best_{fetch}"] = min(same, key=lambda c: c["us"]) if same else None
            pointer, by_tma = row["best_pointer"], row["best_tma"]
            if pointer and by_tma:
                print(f"{'':20s} M={m:5d} best pointer {pointer['us']:7.1f}  best tma {by_tma['us']:7.1f} "
                      f"({pointer['us'] / by_tma['us']:.2f}x)", flush=True)
        out.append(row)
    del weights
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", default=["qkv", "o", "gate_up", "down"], help="Llama-3.1-8B linears")
    parser.add_argument("--m", nargs="+", type=int, default=None, help=f"rows (fp8: {M_DEFAULT}; full: "
                        f"{FULL_M_DEFAULT})")
    parser.add_argument("--mode", choices=("fp8", "full"), default="fp8")
    parser.add_argument("--tall-only", action="store_true", help="full mode: the tall token tiles alone (M > 32)")
    parser.add_argument("--tma", action="store_true", help="each tile also fetched by TMA (gemm_tma)")
    parser.add_argument("--wide-only", action="store_true",
                        help="full mode: the 256-weight-row tall tiles alone, by TMA (FULL_WIDE_TALL_CANDIDATES)")
    families = parser.add_mutually_exclusive_group()  # full mode, the decoded weight as wgmma's shared operand B
    families.add_argument("--smem-b", dest="family", action="store_const", const="smem-b",
                          help="Triton's tiles (FULL_SMEM_B_CANDIDATES)")
    families.add_argument("--gluon", dest="family", action="store_const", const="gluon",
                          help="the Gluon kernel with two decoded buffers (gemm_full_gluon, FULL_GLUON_CANDIDATES)")
    families.add_argument("--gluon-ws", dest="family", action="store_const", const="gluon-ws",
                          help="the producer / consumer Gluon kernel (gemm_full_gluon, FULL_GLUON_WS_CANDIDATES)")
    args = parser.parse_args(argv)
    m_values = args.m or list(FULL_M_DEFAULT if args.mode == "full" else M_DEFAULT)
    rows: list[dict] = []
    for short in args.shapes:  # the file is rewritten after each shape, so a run cut by its time limit keeps them
        name = f"llama3.1-8b.{short}"
        probe_shape(name, *SHAPES[name], m_values, rows, args.mode, args.tall_only, args.tma, args.wide_only,
                    args.family)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
