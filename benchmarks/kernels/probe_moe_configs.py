"""Probe tile configs of the grouped MoE GEMM (plain fp16, nested full, fp8 fast) at decode and prefill sizes.

Session 6's MoE headline found the admitting steps (a 2,048-token chunk = 16,384 expert rows) 30-60 ms slower in
nested full mode than plain fp16; the grouped kernel took full mode's dense tiles, keyed on rows per expert, and
from 64 rows per expert those tiles use the portable decode. This script times a handful of tiles per mode on
Qwen3-30B-A3B's two expert projections, each (mode, tokens, tile) in one CUDA graph over two layers' weights (1.2 GB
of fp16 each, so nothing runs from the 60 MB L2), and prints the best tile per (mode, rows-per-expert bucket).

    cd benchmarks/kernels && python probe_moe_configs.py --out moe_probe.json [--tokens 256 1024] [--modes plain fp8]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch
import triton
from bench_nested_gemm import MOE, geomean, graph_time_us, route

from elastiserve.kernels import configs, formats, nested_moe
from elastiserve.kernels.formats import Nesting
from elastiserve.platforms import current_platform

_G = configs.GemmConfig
TILES = [  # (block_m, block_n, block_k, warps, stages[, max registers per thread])
    (16, 32, 256, 4, 4), (16, 64, 128, 4, 6), (32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
    (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
    # Session 9's offline compile report: full mode holds 246-255 registers on every tile above (8 warps per SM).
    # These trade spills for resident warps: 12 warps per SM (no spill; 304 B; 304 B) and 16 (424 B of spills).
    (64, 64, 64, 4, 3), (128, 64, 64, 4, 3, 168), (128, 64, 64, 4, 4, 168), (128, 128, 64, 8, 3, 128),
]
MODES = ("plain", "full", "full_ptx", "fp8")
COPIES = 2


def candidates(mode: str) -> list[configs.GemmConfig]:
    out = []
    for bm, bn, bk, warps, stages, *cap in TILES:
        config = _G(bm, bn, bk, num_warps=warps, num_stages=stages, ptx_decode=mode == "full_ptx",
                    max_registers=cap[0] if cap else None)
        if mode == "fp8" and bk < 64:
            continue
        out.append(config)
    return out


def make_layers():
    hidden, inter, experts = MOE["hidden"], MOE["expert_inter"], MOE["experts"]
    layers = []
    for i in range(COPIES):
        gen = torch.Generator("cuda").manual_seed(100 + i)
        gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).half()
        down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02).half()
        layers.append({"gate_up": (gate_up, *formats.split(gate_up, Nesting.E4M3)),
                       "down": (down, *formats.split(down, Nesting.E4M3))})
    return layers


def call(mode: str, x, weights, offsets, config):
    plain, upper, lower = weights
    if mode == "plain":
        return nested_moe.grouped_gemm_fp16(x, plain, offsets, config=config)
    kernel_mode = "fp8" if mode == "fp8" else "full"
    return nested_moe.nested_moe_gemm(x, upper, lower, offsets, Nesting.E4M3, kernel_mode, config=config)


def probe(tokens_values, modes) -> list[dict]:
    hidden, inter, experts, top_k = MOE["hidden"], MOE["expert_inter"], MOE["experts"], MOE["top_k"]
    layers = make_layers()
    rows = []
    for tokens in tokens_values:
        t = tokens * top_k
        inputs = {"gate_up": torch.randn(t, hidden, device="cuda").half(),
                  "down": torch.randn(t, inter, device="cuda").half()}
        offsets = [route(tokens, experts, top_k, seed) for seed in range(COPIES)]
        for mode in modes:
            for config in candidates(mode):
                times = {}
                for proj in ("gate_up", "down"):
                    calls = [lambda i=i, offs=offs, x=inputs[proj], mode=mode, proj=proj, config=config:
                             call(mode, x, layers[i][proj], offs, config)
                             for i, offs in enumerate(offsets)]
                    try:
                        times[proj] = graph_time_us(calls)
                    except Exception as exc:  # a tile that does not fit shared memory on this GPU
                        times[proj] = None
                        print(f"  {mode} {config} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                if None in times.values():
                    continue
                row = {"tokens": tokens, "rows_per_expert": t // experts, "mode": mode, "config": asdict(config),
                       "us": times, "layer_us": times["gate_up"] + times["down"]}
                rows.append(row)
                cap = f" r{config.max_registers}" if config.max_registers else ""
                print(f"tokens={tokens:5d} {mode:8s} {config.block_m:3d}x{config.block_n:3d}x{config.block_k:3d} "
                      f"w{config.num_warps} s{config.num_stages}{cap}  gate_up {times['gate_up']:8.1f}  down "
                      f"{times['down']:8.1f}  layer {row['layer_us']:8.1f} us", flush=True)
    return rows


def best_per_bucket(rows: list[dict]) -> dict:
    """Per (mode, tokens): the fastest tile for the whole layer, and the table's current choice beside it."""
    out = {}
    for key in sorted({(r["mode"], r["tokens"]) for r in rows}):
        group = [r for r in rows if (r["mode"], r["tokens"]) == key]
        best = min(group, key=lambda r: r["layer_us"])
        out[f"{key[0]}@{key[1]}"] = {"best": best["config"], "layer_us": best["layer_us"],
                                     "rows_per_expert": best["rows_per_expert"]}
    plain = {}
    for r in rows:  # a probe of other modes only has no plain rows: no ratio then
        if r["mode"] == "plain" and r["layer_us"] < plain.get(r["tokens"], {"layer_us": float("inf")})["layer_us"]:
            plain[r["tokens"]] = r
    for key, value in out.items():
        tokens = int(key.split("@")[1])
        if tokens in plain:
            value["vs_best_plain"] = plain[tokens]["layer_us"] / value["layer_us"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="*", default=[256, 1024, 2048, 4096])
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this probe needs a GPU", file=sys.stderr)
        return 2
    rows = probe(args.tokens, args.modes)
    best = best_per_bucket(rows)
    p = current_platform()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "arch": p.arch, "torch": torch.__version__,
                   "triton": triton.__version__, "moe": MOE, "rows": rows, "best": best,
                   "geomean_best_full_vs_plain": geomean(
                       v["vs_best_plain"] for k, v in best.items() if k.startswith("full") and "vs_best_plain" in v)},
                  f, indent=2)
    for key, value in best.items():
        print(f"{key:16s} {value['layer_us']:8.1f} us  x{value.get('vs_best_plain', float('nan')):.2f} of plain  "
              f"{value['best']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
