"""Nested GEMM vs cuBLAS on the GPU: torch.matmul fp16, torch._scaled_mm fp8, ours full, ours fast.

Timing: one CUDA graph per (method, shape) calls the GEMM on enough weight copies to exceed the L2 (~400 MB of
fp16 weights), is replayed, and the time is divided by calls; so every call reads cold weights and no CPU launch
cost is measured. ``_scaled_mm`` gets pre-quantized activations with per-tensor scales (its best case); our fp8
path includes its per-token activation quantization.

    python benchmarks/kernels/bench_nested_gemm.py --out nested_gemm.json [--tune] [--no-moe]
"""

from __future__ import annotations

import argparse
import json
import math
import platform as host_platform
import sys

import torch
import triton

from elastiserve.kernels import configs, formats, fp8_activations, nested_gemm, nested_moe
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.fp8_activations import quantize_per_token
from elastiserve.platforms import current_platform

SHAPES = {  # name -> (N, K)
    "llama3.1-8b.qkv": (6144, 4096),
    "llama3.1-8b.o": (4096, 4096),
    "llama3.1-8b.gate_up": (28672, 4096),
    "llama3.1-8b.down": (4096, 14336),
    "qwen3-8b.qkv": (6144, 4096),
    "qwen3-8b.o": (4096, 4096),
    "qwen3-8b.gate_up": (24576, 4096),
    "qwen3-8b.down": (4096, 12288),
}
# Only when named in --shapes: Llama-3.1-8B's lm_head (1.05 GB in fp16), nested under --nest-lm-head.
EXTRA_SHAPES = {"llama3.1-8b.lm_head": (128256, 4096)}
M_VALUES = (1, 16, 64, 256, 1024, 4096)
MOE = {"name": "qwen3-30b-a3b", "hidden": 2048, "expert_inter": 768, "experts": 128, "top_k": 8}
ROTATE_BYTES = 400 << 20
REPLAYS = 20


def graph_time_us(calls) -> float:
    """Capture ``calls`` (a list of no-arg callables) in one graph, replay it, return microseconds per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm up: compiles kernels, settles allocator
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1000 / (REPLAYS * len(calls))


def copies_for(bytes_per_copy: int) -> int:
    return max(2, math.ceil(ROTATE_BYTES / bytes_per_copy))


def make_weights(n: int, k: int, copies: int):
    """fp16, fp8 (per-tensor scale, pre-transposed view for _scaled_mm) and nested planes, per copy."""
    out = []
    for i in range(copies):
        w = (torch.randn(n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) * 0.02).half()
        upper, lower = formats.split(w, Nesting.E4M3)
        w_scale = (w.abs().max().float() / 448).reshape(())
        w8 = (w.float() / w_scale).to(torch.float8_e4m3fn)
        out.append({"w": w, "w8t": w8.t(), "w_scale": w_scale, "upper": upper, "lower": lower})
    return out


def bench_dense(name: str, n: int, k: int, m_values, tune: bool) -> list[dict]:
    weights = make_weights(n, k, copies_for(n * k * 2))
    rows = []
    for m in m_values:
        x = torch.randn(m, k, device="cuda").half()
        x_scale = (x.abs().max().float() / 448).reshape(())
        x8 = (x.float() / x_scale).to(torch.float8_e4m3fn)
        fast_mode = nested_gemm.fast_mode_for(m)
        if tune:
            for mode in ("full", "weight_only", "fp8"):
                tune_shape(mode, x, weights, n, k, m)
        times = time_dense_methods(x, x8, x_scale, weights)
        times["ours_fast"] = times[f"ours_{fast_mode}"]
        row = {"shape": name, "N": n, "K": k, "M": m, "fast_mode": fast_mode, "us": times,
               "full_vs_fp16": times["torch_fp16"] / times["ours_full"],
               "fast_vs_fp16": times["torch_fp16"] / times["ours_fast"],
               "fast_vs_scaled_mm": times["scaled_mm_fp8"] / times["ours_fast"],
               "scaled_mm_vs_fp16": times["torch_fp16"] / times["scaled_mm_fp8"],
               "fp8_rows_vs_fp16": times["torch_fp16"] / times["ours_fp8_rows"],
               "configs": {mode: repr(chosen_config(mode, m, n, k)) for mode in ("full", "weight_only", "fp8")}}
        rows.append(row)
        print(f"{name:22s} M={m:5d}  fp16 {times['torch_fp16']:8.1f}  fp8 {times['scaled_mm_fp8']:8.1f}  "
              f"full {times['ours_full']:8.1f} ({row['full_vs_fp16']:.2f}x)  fast[{fast_mode}] "
              f"{times['ours_fast']:8.1f} ({row['fast_vs_fp16']:.2f}x fp16, {row['fast_vs_scaled_mm']:.2f}x fp8)  "
              f"wo {times['ours_weight_only']:7.1f} fp8 {times['ours_fp8']:7.1f} fp8-rows "
              f"{times['ours_fp8_rows']:7.1f} ({row['fp8_rows_vs_fp16']:.2f}x) "
              f"full-kernel {times['ours_full_kernel']:7.1f}", flush=True)
    return rows


def time_dense_methods(x, x8, x_scale, weights) -> dict[str, float]:
    times = {
        "torch_fp16": graph_time_us([lambda c=c: torch.matmul(x, c["w"].t()) for c in weights]),
        "scaled_mm_fp8": graph_time_us([
            lambda c=c: torch._scaled_mm(x8, c["w8t"], scale_a=x_scale, scale_b=c["w_scale"],
                                         out_dtype=torch.float16) for c in weights]),
    }
    for mode in ("full", "weight_only", "fp8"):
        times[f"ours_{mode}_kernel"] = graph_time_us([
            lambda c=c, mode=mode: nested_gemm.nested_gemm(x, c["upper"], c["lower"], None, Nesting.E4M3, mode)
            for c in weights])
    # What a model runs: the op picks the fast mode's kernel by M and, in full mode from MATERIALIZE_MIN_M rows on,
    # decodes the weight once and calls the vendor fp16 GEMM (the fused kernel's time is kept beside it).
    times["ours_full"] = graph_time_us([lambda c=c: nested_gemm.nested_linear_op(
        x, c["upper"], c["lower"], None, int(Nesting.E4M3), False) for c in weights])
    for mode in ("weight_only", "fp8"):
        times[f"ours_{mode}"] = times[f"ours_{mode}_kernel"]
    # The fp8 GEMM alone on rows already quantized, as the engine runs qkv, gate_up and down in fast mode since
    # session 17 (the norm or SiLU-and-mul before them writes the fp8 rows; o_proj still quantizes for itself).
    q, q_scale = quantize_per_token(x)
    times["ours_fp8_rows"] = graph_time_us([lambda c=c: nested_gemm.nested_gemm(
        q, c["upper"], c["lower"], None, Nesting.E4M3, "fp8", x_scale=q_scale) for c in weights])
    return times


def chosen_config(mode: str, m: int, n: int, k: int) -> configs.GemmConfig:
    p = current_platform()
    return configs.choose_config(p.arch, mode, m, n, k, p.num_sms)


def tune_shape(mode: str, x, weights, n: int, k: int, m: int) -> None:
    def time_fn(config):
        return graph_time_us([lambda c=c: nested_gemm.nested_gemm(x, c["upper"], c["lower"], None, Nesting.E4M3,
                                                                 mode, config=config) for c in weights[:2]])
    best = configs.tune(current_platform().arch, mode, n, k, m, time_fn)
    print(f"  tuned {mode} N={n} K={k} M={m}: {best}", flush=True)


def route(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """expert_offsets for random top-k routing (each token picks top_k distinct experts)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    choice = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(counts, 0)
    return offsets


def bench_moe(token_values) -> list[dict]:
    hidden, inter, experts, top_k = MOE["hidden"], MOE["expert_inter"], MOE["experts"], MOE["top_k"]
    layer_bytes = experts * 3 * inter * hidden * 2
    copies = copies_for(layer_bytes)
    layers = []
    for i in range(copies):
        gen = torch.Generator("cuda").manual_seed(100 + i)
        w_gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).half()
        w_down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02).half()
        layers.append((formats.split(w_gate_up, Nesting.E4M3), formats.split(w_down, Nesting.E4M3)))
        del w_gate_up, w_down
    rows = []
    for tokens in token_values:
        t = tokens * top_k
        x = torch.randn(t, hidden, device="cuda").half()
        h = torch.randn(t, inter, device="cuda").half()
        offsets = [route(tokens, experts, top_k, seed) for seed in range(copies)]
        times = time_moe_modes(x, h, layers, offsets)
        fast_mode = nested_gemm.fast_mode_for(t, grouped=True)
        times["ours_fast"] = times[f"ours_{fast_mode}"]
        row = {"shape": f"{MOE['name']}.experts", "tokens": tokens, "rows": t, "fast_mode": fast_mode, "us": times,
               "fast_vs_full": times["ours_full"] / times["ours_fast"]}
        rows.append(row)
        print(f"moe tokens={tokens:5d} rows={t:6d}  full {times['ours_full']:8.1f}  fast[{fast_mode}] "
              f"{times['ours_fast']:8.1f} ({row['fast_vs_full']:.2f}x)  wo {times['ours_weight_only']:8.1f} "
              f"fp8 {times['ours_fp8']:8.1f}", flush=True)
    return rows


def time_moe_modes(x, h, layers, offsets) -> dict[str, float]:
    def layer_call(i, mode):
        (gu_u, gu_l), (d_u, d_l) = layers[i]
        nested_moe.nested_moe_gemm(x, gu_u, gu_l, offsets[i], Nesting.E4M3, mode)
        nested_moe.nested_moe_gemm(h, d_u, d_l, offsets[i], Nesting.E4M3, mode)

    return {f"ours_{mode}": graph_time_us([lambda i=i, mode=mode: layer_call(i, mode) for i in range(len(layers))])
            for mode in ("full", "weight_only", "fp8")}


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarize(dense: list[dict], moe: list[dict]) -> dict:
    small = [r for r in dense if r["M"] <= 256]
    large = [r for r in dense if r["M"] >= 1024]
    return {
        "full_vs_fp16": geomean(r["full_vs_fp16"] for r in dense),
        "fast_vs_fp16_m_le_256": geomean(r["fast_vs_fp16"] for r in small),
        "fast_vs_fp16_m_ge_1024": geomean(r["fast_vs_fp16"] for r in large),
        "fast_vs_scaled_mm": geomean(r["fast_vs_scaled_mm"] for r in dense),
        "fast_slower_than_scaled_mm": [(r["shape"], r["M"]) for r in dense if r["fast_vs_scaled_mm"] < 1.0],
        "moe_fast_vs_full": geomean(r["fast_vs_full"] for r in moe),
        "targets": {"full_vs_fp16": 0.95, "fast_vs_fp16_m_le_256": 1.7, "fast_vs_fp16_m_ge_1024": 1.6,
                    "fast_vs_scaled_mm_min": 1.0},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--m", type=int, nargs="*", default=list(M_VALUES))
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=[*SHAPES, *EXTRA_SHAPES])
    parser.add_argument("--tune", action="store_true", help="time candidate tile configs per shape first")
    parser.add_argument("--no-moe", action="store_true")
    parser.add_argument("--no-full-tall-tiles", action="store_true",
                        help="full mode at 33-256 rows off sm90's TMA tiles: the materialized weight from 65 rows, "
                             "the pointer tiles below (configs.FULL_SM90_TALL_ON, on since session 33)")
    parser.add_argument("--full-tall-min-rows", type=int, choices=range(33, 66), metavar="33-65",
                        help="full mode's TMA tiles from this many rows for every weight class "
                             "(configs.FULL_TMA_MIN_M_BY_CLASS: 33 for every class since session 36)")
    parser.add_argument("--quant-split-rows", type=int, nargs=2, metavar=("LOW", "HIGH"),
                        help="fast mode's quantizer splits rows longer than 4,096 over programs at LOW-HIGH rows "
                             "(fp8_activations.QUANT_SPLIT_ROWS; no arch takes it as committed)")
    args = parser.parse_args(argv)
    if args.quant_split_rows:
        fp8_activations.QUANT_SPLIT_ROWS[current_platform().arch] = tuple(args.quant_split_rows)
    if args.no_full_tall_tiles:
        configs.FULL_SM90_TALL_ON = False
    if args.full_tall_min_rows is not None:
        configs.FULL_TMA_MIN_M_BY_CLASS = dict.fromkeys(configs.FULL_WEIGHT_CLASSES, args.full_tall_min_rows)
    if not torch.cuda.is_available():
        print("this benchmark needs a GPU", file=sys.stderr)
        return 2
    p = current_platform()
    dense = []
    seen = {}
    for name in args.shapes:
        n, k = SHAPES.get(name) or EXTRA_SHAPES[name]
        if (n, k) in seen:  # Qwen3-8B qkv/o share Llama's shapes: reuse, but keep one row per model shape
            dense += [{**row, "shape": name} for row in seen[(n, k)]]
            continue
        rows = bench_dense(name, n, k, args.m, args.tune)
        seen[(n, k)] = rows
        dense += rows
        torch.cuda.empty_cache()
    moe = [] if args.no_moe else bench_moe(args.m)
    result = {
        "device": torch.cuda.get_device_name(0), "arch": p.arch, "num_sms": p.num_sms,
        "fast_gemm": p.fast_gemm.value, "torch": torch.__version__, "triton": triton.__version__,
        "python": host_platform.python_version(), "settings": {"full_tall_tiles": configs.FULL_SM90_TALL_ON,
        "full_tall_min_rows": configs.FULL_TMA_MIN_M_BY_CLASS,
        "quant_split_rows": fp8_activations.QUANT_SPLIT_ROWS.get(p.arch)},
        "timing": f"CUDA graph replay x{REPLAYS}, weights rotated "
        f"over >= {ROTATE_BYTES >> 20} MB", "dense": dense, "moe": moe, "summary": summarize(dense, moe),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
