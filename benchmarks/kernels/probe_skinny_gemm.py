"""One-shot GPU probe: the skinny (GEMV-style) decode GEMM against torch fp16 and the current tl.dot nested kernel.

For Llama-3.1-8B shapes and M in {1, 2, 4, 8}: torch.matmul fp16; ``nested_gemm`` with ``configs.choose_config``
(full, weight_only: the tl.dot kernel, whatever ``SKINNY_MAX_M`` says); the skinny kernel in plain, full and
weight_only modes over a short candidate list (``TILES_M1`` at M = 1, ``TILES_MULTI`` above; split-K from
``skinny_configs.with_skinny_split``, the PTX decode for the nested modes). CUDA-graph replay over weight copies past
the L2 (bench_nested_gemm's method); each candidate's output is first checked against its reference. Prints one line per
(shape, M), then per (mode, shape, M) the best skinny config with its speed-up over torch fp16 and over the nested
kernel (>1: skinny is faster); writes every timing to JSON with the weight bytes moved per second.
``compiled_variants`` counts the Triton compiles (under ``MAX_VARIANTS``) so the run, compiles included, stays well
inside 240 s; ``--budget-s`` stops early (``"truncated": true``) if it does not.

    python benchmarks/kernels/probe_skinny_gemm.py --out skinny.json [--quick]
    python benchmarks/kernels/probe_skinny_gemm.py --out o.json --shapes o down --m 1 --modes weight_only \
        --tiles 8,1024,8 8,2048,16      # (block_n, block_k, num_warps) candidates instead of the lists below
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nested_gemm import copies_for, graph_time_us, make_weights

from elastiserve.kernels import configs, nested_gemm, skinny_configs, skinny_gemm
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.skinny_configs import SkinnyConfig
from elastiserve.platforms import current_platform

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
EXTRA_SHAPES = {"lm_head": (128256, 4096)}  # only when named in --shapes: the plain fp16 lm_head (1.05 GB)
M_VALUES = (1, 2, 4, 8)
MODES = ("plain", "full", "weight_only")
SHORT = {"plain": "fp16", "full": "full", "weight_only": "w8"}
WEIGHT_BYTES = {"plain": 2, "full": 2, "weight_only": 1}  # bytes of weight read per element
# (block_n, block_k, num_warps), BLOCK_N * BLOCK_K <= 16384. M = 1 keeps whole-tile accumulators (deferred K
# reduction) in every one; above it the narrower tiles decide between deferred and per-step reduction
# (skinny_gemm.defers_reduction), and (8, 256, 8) is the one tile that still defers at M = 8.
TILES_M1 = ((8, 512, 4), (16, 256, 4), (16, 512, 4), (8, 1024, 8), (16, 1024, 8), (32, 512, 8))
TILES_MULTI = ((8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8), (8, 256, 8))
NUM_STAGES = 3
MAX_VARIANTS = 150  # Triton compiles: ~1 s each on the H200 host
MAX_REL_ERR = 1e-2  # a candidate further than this from its reference is reported as failed, never as the best
H200 = ("sm90", 132)  # (arch, SMs) the variant bound is checked for
DEVICE = "cuda"  # the CPU smoke test swaps in "cpu" (and fake weights and timer) to run main's own logic


def candidates(mode: str, m: int, n: int, k: int, num_sms: int, tiles=None) -> list[SkinnyConfig]:
    tiles = tiles or (TILES_M1 if m == 1 else TILES_MULTI)
    return [skinny_configs.with_skinny_split(SkinnyConfig(bn, bk, warps, NUM_STAGES, ptx_decode=mode != "plain"), n, k,
                                      num_sms) for bn, bk, warps in tiles]


def compiled_variants(shapes, m_values, arch: str = H200[0], num_sms: int = H200[1], modes=MODES,
                      tiles=None) -> set[tuple]:
    """Every kernel specialization the probe compiles: the constexprs each launcher derives, plus Triton's own
    specialization of an integer argument equal to 1 (M = 1); N, K and the strides are multiples of 16 here."""
    keys = set()
    for n, k in shapes:
        for m in m_values:
            for mode in modes:
                for c in candidates(mode, m, n, k, num_sms, tiles):
                    m_pad = triton.next_power_of_2(m)
                    keys.add(("skinny", mode, c.block_n, c.block_k, c.num_warps, c.num_stages, c.ptx_decode,
                              c.split_k > 1, k % (c.block_k * c.split_k) == 0,
                              skinny_gemm.defers_reduction(c, m_pad, mode), m_pad))
                    if c.split_k > 1:
                        keys.add(("split_k_reduce", c.split_k, m == 1))
            for mode in ("full", "weight_only"):
                c = configs.choose_config(arch, mode, m, n, k, num_sms)
                keys.add(("nested", mode, c, m == 1, k % (c.block_k * c.split_k) == 0))
                if c.split_k > 1:
                    keys.add(("split_k_reduce", c.split_k, m == 1))
    return keys


def _time(calls) -> tuple[float | None, str | None]:
    try:
        return graph_time_us(calls), None
    except Exception as exc:  # a candidate that runs out of registers or shared memory on this GPU
        return None, str(exc)[:200]


def _row(shape, n, k, m, mode, kind, us, error=None, config=None) -> dict:
    gbps = n * k * WEIGHT_BYTES[mode] / us / 1e3 if us else None
    return {"shape": shape, "N": n, "K": k, "M": m, "mode": mode, "kind": kind, "us": us, "weight_gbps": gbps,
            "config": config, "error": error}


def _calls(x, weights, mode: str, kind: str, config=None) -> list:
    """One no-argument call per weight copy (graph_time_us replays them all)."""
    if kind == "torch_fp16":
        return [lambda c=c: torch.matmul(x, c["w"].t()) for c in weights]
    if kind == "nested":
        return [lambda c=c: nested_gemm.nested_gemm(x, c["upper"], c["lower"], None, Nesting.E4M3, mode, config=config)
                for c in weights]
    if mode == "plain":
        return [lambda c=c: skinny_gemm.skinny_linear(x, c["w"], None, config) for c in weights]
    return [lambda c=c: skinny_gemm.skinny_nested(x, c["upper"], c["lower"], None, Nesting.E4M3, mode, config=config)
            for c in weights]


def _references(x, copy) -> dict[str, torch.Tensor]:
    """fp32 results each mode must reproduce (full mode rebuilds the fp16 weight exactly)."""
    exact = x.float() @ copy["w"].float().T
    weight_only = nested_gemm.nested_linear_ref(x, copy["upper"], copy["lower"], None, Nesting.E4M3, "weight_only")
    return {"plain": exact, "full": exact, "weight_only": weight_only.float()}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6))


def probe_shape(name: str, n: int, k: int, m_values, num_sms: int, deadline: float, rows: list, modes=MODES,
                tiles=None) -> bool:
    """Time every method for one shape; False once past the deadline."""
    weights = make_weights(n, k, copies_for(n * k * 2))
    for m in m_values:
        x = torch.randn(m, k, device=DEVICE).half()
        refs = _references(x, weights[0])
        us, err = _time(_calls(x, weights, "plain", "torch_fp16"))
        rows.append(_row(name, n, k, m, "plain", "torch_fp16", us, err))
        for mode in ("full", "weight_only"):
            config = configs.choose_config(current_platform().arch, mode, m, n, k, num_sms)
            us, err = _time(_calls(x, weights, mode, "nested", config))
            rows.append(_row(name, n, k, m, mode, "nested", us, err, repr(config)))
        for mode in modes:
            for config in candidates(mode, m, n, k, num_sms, tiles):
                if time.monotonic() > deadline:
                    return False
                calls = _calls(x, weights, mode, "skinny", config)
                try:  # a first GPU run of this kernel: a fast wrong answer must not win
                    rel_err = _rel_err(calls[0](), refs[mode])
                except Exception:  # recorded by _time below
                    rel_err = None
                us, err = _time(calls)
                if rel_err is not None and rel_err > MAX_REL_ERR:
                    us, err = None, f"wrong result: max error {rel_err:.3g} of max |y|"
                row = _row(name, n, k, m, mode, "skinny", us, err, asdict(config))
                row["defer"] = skinny_gemm.defers_reduction(config, triton.next_power_of_2(m), mode)
                row["rel_err"] = rel_err
                rows.append(row)
        print_shape_line(rows, name, m)
    del weights
    torch.cuda.empty_cache()
    return True


def _find(rows, shape, m, mode, kind) -> list[dict]:
    return [r for r in rows if (r["shape"], r["M"], r["mode"], r["kind"]) == (shape, m, mode, kind) and r["us"]]


def best_skinny(rows: list) -> list[dict]:
    """Per (mode, shape, M): the fastest skinny config and its speed-up over torch fp16 and the nested kernel."""
    out = []
    for shape, m in dict.fromkeys((r["shape"], r["M"]) for r in rows):
        torch_row = _find(rows, shape, m, "plain", "torch_fp16")
        for mode in MODES:
            timed = _find(rows, shape, m, mode, "skinny")
            if not timed:
                continue
            best = min(timed, key=lambda r: r["us"])
            nested = _find(rows, shape, m, mode, "nested")
            out.append({"mode": mode, "shape": shape, "M": m, "us": best["us"], "weight_gbps": best["weight_gbps"],
                        "config": best["config"], "defer": best["defer"],
                        "vs_torch_fp16": torch_row[0]["us"] / best["us"] if torch_row else None,
                        "vs_nested": nested[0]["us"] / best["us"] if nested else None})
    return out


def print_shape_line(rows, shape, m) -> None:
    cells = []
    for mode, kind in (("plain", "torch_fp16"), ("full", "nested"), ("weight_only", "nested"), ("plain", "skinny"),
                       ("full", "skinny"), ("weight_only", "skinny")):
        timed = _find(rows, shape, m, mode, kind)
        best = min(timed, key=lambda r: r["us"]) if timed else None
        label = "torch" if kind == "torch_fp16" else f"{kind}/{SHORT[mode]}"
        cells.append(f"{label} {best['us']:6.1f}us {best['weight_gbps']:5.0f}GB/s" if best else f"{label} failed")
    print(f"{shape:8s} M={m}  " + "  ".join(cells), flush=True)


def _ratio(value) -> str:
    return f"{value:.2f}x" if value else "  -  "


def _tile(text: str) -> tuple[int, int, int]:
    block_n, block_k, num_warps = (int(v) for v in text.split(","))
    return block_n, block_k, num_warps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="qkv at M = 1 only")
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop starting new timings after this")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES | EXTRA_SHAPES),
                        help="default: the four linears (lm_head only when named)")
    parser.add_argument("--m", nargs="+", type=int, help=f"rows (default {M_VALUES})")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tiles", nargs="+", type=_tile, help="block_n,block_k,num_warps candidates for every M")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this probe needs a GPU", file=sys.stderr)
        return 2
    start = time.monotonic()
    known = SHAPES | EXTRA_SHAPES
    shapes = {"qkv": SHAPES["qkv"]} if args.quick else {name: known[name] for name in args.shapes or SHAPES}
    m_values = (1,) if args.quick else tuple(args.m or M_VALUES)
    p = current_platform()
    variants = len(compiled_variants(shapes.values(), m_values, p.arch, p.num_sms, args.modes, args.tiles))
    print(f"{p.device_name} ({p.arch}, {p.num_sms} SMs): {variants} kernel variants to compile", flush=True)
    rows: list[dict] = []
    complete = all(probe_shape(name, n, k, m_values, p.num_sms, start + args.budget_s, rows, args.modes, args.tiles)
                   for name, (n, k) in shapes.items())
    best = best_skinny(rows)
    print("\nbest skinny config per (mode, shape, M); speed-up over torch fp16 / over the nested tl.dot kernel")
    for b in best:
        c = b["config"]
        print(f"{b['mode']:11s} {b['shape']:8s} M={b['M']}  {b['us']:6.1f}us {b['weight_gbps']:5.0f}GB/s  "
              f"{c['block_n']:2d}x{c['block_k']:<4d} w{c['num_warps']} split{c['split_k']} "
              f"{'defer' if b['defer'] else 'step '}  {_ratio(b['vs_torch_fp16'])} {_ratio(b['vs_nested'])}")
    result = {"device": torch.cuda.get_device_name(0), "arch": p.arch, "num_sms": p.num_sms,
              "torch": torch.__version__, "triton": triton.__version__, "variants": variants,
              "truncated": not complete, "seconds": time.monotonic() - start, "rows": rows, "best": best}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'TRUNCATED at the budget; ' if not complete else ''}{result['seconds']:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
