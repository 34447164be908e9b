"""One-shot GPU probe: tile configs of the nested GEMM at decode sizes, and the merged full-mode path at prefill sizes.

Decode (M = 1, 16): each candidate tile config (split-K chosen for occupancy as ``configs.choose_config`` does) in
full mode (portable and packed-PTX decode), weight-only and fp8 modes, against torch fp16, CUDA-graph timed over
weight copies past the L2 (the kernel benchmark's method). Prefill (M >= 128): the fused full-mode kernel against
``merge_planes`` + torch fp16 GEMM.

    python benchmarks/kernels/probe_gemm_configs.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nested_gemm import copies_for, graph_time_us, make_weights

from elastiserve.kernels import configs, nested_gemm
from elastiserve.kernels.formats import Nesting
from elastiserve.platforms import current_platform

G = configs.GemmConfig
DECODE_CANDIDATES = [  # block_n, block_k, warps, stages (block_m 16, weight as operand A)
    (64, 256, 4, 4), (128, 128, 4, 4), (128, 256, 8, 3), (64, 128, 4, 6), (32, 256, 4, 4), (128, 64, 4, 8),
    (256, 128, 8, 3),
]
SHAPES = {"qkv": (6144, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}


def with_split(config: configs.GemmConfig, m: int, n: int, k: int) -> configs.GemmConfig:
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    split = configs._split_for_occupancy(tiles, -(-k // config.block_k), current_platform().num_sms)
    return replace(config, split_k=split)


def time_torch(x, weights) -> float:
    return graph_time_us([lambda c=c: torch.matmul(x, c["w"].t()) for c in weights])


def time_ours(x, weights, mode: str, config=None) -> float:
    return graph_time_us([lambda c=c: nested_gemm.nested_gemm(x, c["upper"], c["lower"], None, Nesting.E4M3, mode,
                                                               config=config) for c in weights])


def time_merged(x, weights) -> float:
    return graph_time_us([lambda c=c: nested_gemm.full_via_merged_weight(x, c["upper"], c["lower"], None,
                                                                          Nesting.E4M3) for c in weights])


DECODE_MODES = ("full", "full_ptx", "weight_only", "weight_only_ptx", "fp8")


def probe_decode(name: str, n: int, k: int, weights, out: list, modes=DECODE_MODES) -> None:
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda").half()
        fp16 = time_torch(x, weights)
        for bn, bk, warps, stages in DECODE_CANDIDATES:
            config = with_split(G(16, bn, bk, num_warps=warps, num_stages=stages), m, n, k)
            row = {"shape": name, "M": m, "config": asdict(config), "torch_fp16_us": fp16}
            for mode in modes:
                try:
                    if mode.endswith("_ptx"):  # the packed-word PTX decode (weight_decode.decode_weight_tile_ptx)
                        row[mode] = time_ours(x, weights, mode.removesuffix("_ptx"), replace(config, ptx_decode=True))
                    else:
                        row[mode] = time_ours(x, weights, mode, replace(config, ptx_decode=False))
                except Exception as exc:  # out of shared memory on this GPU, say
                    row[mode] = None
                    row[f"{mode}_error"] = str(exc)[:200]
            out.append(row)
            cells = "  ".join(f"{mo} {row[mo]:7.1f} ({fp16 / row[mo]:.2f}x)" if row[mo] else f"{mo} failed"
                              for mo in modes)
            print(f"{name:8s} M={m:3d} {bn:4d}x{bk:4d} w{warps} s{stages} split{config.split_k}  fp16 {fp16:7.1f}  "
                  f"{cells}", flush=True)


def probe_prefill(name: str, n: int, k: int, weights, out: list) -> None:
    for m in (128, 256, 1024, 4096):
        x = torch.randn(m, k, device="cuda").half()
        row = {"shape": name, "M": m, "torch_fp16_us": time_torch(x, weights),
               "fused_full_us": time_ours(x, weights, "full"), "merged_full_us": time_merged(x, weights)}
        out.append(row)
        print(f"{name:8s} M={m:5d}  fp16 {row['torch_fp16_us']:8.1f}  fused {row['fused_full_us']:8.1f} "
              f"({row['torch_fp16_us'] / row['fused_full_us']:.2f}x)  merged {row['merged_full_us']:8.1f} "
              f"({row['torch_fp16_us'] / row['merged_full_us']:.2f}x)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--parts", nargs="*", default=["decode", "prefill"], choices=["decode", "prefill"])
    parser.add_argument("--modes", nargs="*", default=list(DECODE_MODES), choices=DECODE_MODES, help="decode part")
    args = parser.parse_args()
    decode, prefill = [], []
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = make_weights(n, k, copies_for(n * k * 2))
        if "decode" in args.parts:
            probe_decode(name, n, k, weights, decode, args.modes)
        if "prefill" in args.parts:
            probe_prefill(name, n, k, weights, prefill)
        del weights
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "decode": decode,
                                          "prefill": prefill}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
