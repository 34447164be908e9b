"""Per-kernel device time of one decode step in full and fast mode, side by side: where fast mode's step goes.

Fast mode at batch 1 was 1.43x full on the H200 (target 1.6x; BENCHMARKS.md, Engine, session 18), and fp8 from one
quantized row saved 36 us a step where the GEMM table predicted ~215 us. This splits a step into kernel families
(GEMMs, norms, attention, ...) per mode, so the gap can be placed. A DPS engine with random weights decodes a batch;
each (batch, mode) replays the step ``--replays`` times under ``torch.profiler``. On a GPU CUPTI reports the kernels
a CUDA graph launches; on the CPU (a smoke run) the profiler's CPU operators stand in for kernels.

    python benchmarks/engine/profile_decode_kernels.py --model llama-3.1-8b --batch 1 4 --kv-gib 12 --out k.json
    python benchmarks/engine/profile_decode_kernels.py --device cpu --model '{...tiny config...}' --batch 1 --out k.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from decode_setup import (
    GIB,
    build_engine,
    decode_inputs,
    decode_step_fn,
    first_rows,
    metadata,
    resolve_model,
    time_calls,
)

# Kernel name -> family, first match wins. Triton kernels keep their Python names (one name for every
# specialization: the quantizing and the plain RMSNorm are both ``_rms_norm_kernel``); vendor GEMM names vary.
FAMILIES = (
    ("nested GEMM (fp8 / weight-only / full)", r"_nested_gemm_kernel"),
    ("skinny GEMM", r"_skinny_gemm_kernel"),
    ("split-K reduce", r"_split_k_reduce_kernel"),
    ("grouped MoE GEMM", r"_nested_moe_kernel|_tile_map_kernel|_moe_combine_kernel"),
    ("norm (plain or quantizing)", r"rms_norm"),
    ("SiLU-and-mul (plain or quantizing)", r"silu"),
    ("quantizer (o_proj's input; split routes' codes)", r"quantize|_chunk_max_kernel"),
    ("rotary (with the KV write: rotary_kv_write)", r"rotary"),
    ("attention", r"attention"),
    ("KV write", r"kv_write"),
    ("merge planes (full mode, many rows)", r"merge_planes"),
    ("vendor GEMM (lm_head, fp16 layers)", r"gemm|cutlass|cublas|nvjet|matmul|addmm|linear|\bmm\b"),
    ("copies / fills", r"copy|fill|memcpy|memset|cat|index"),
)


def family(name: str) -> str:
    lowered = name.lower()
    for label, pattern in FAMILIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def kernel_times(fn, device: torch.device, replays: int) -> dict[str, Any]:
    """Summed self time per kernel name over ``replays`` calls of ``fn`` (device kernels on a GPU, CPU operators
    otherwise), in microseconds per call."""
    fn()  # warm: the first replay may still load modules
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(replays):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device != (device.type == "cuda"):
            continue
        us = event.self_device_time_total if on_device else event.self_cpu_time_total
        if us <= 0:
            continue
        per_kernel[event.name] += us / replays
        counts[event.name] += 1
    families: dict[str, float] = defaultdict(float)
    for name, us in per_kernel.items():
        families[family(name)] += us
    return {"total_us": sum(per_kernel.values()), "wall_us": wall_us(fn, device, replays),
            "families_us": dict(families),
            "kernels": {name: {"us": us, "calls_per_step": counts[name] / replays} for name, us in per_kernel.items()}}


def wall_us(fn, device: torch.device, replays: int) -> float:
    """Median time of one call of ``fn`` outside the profiler: what the kernels' sum misses is the time the GPU sits
    between them (launch gaps inside the graph, one kernel's tail before the next starts)."""
    return time_calls(fn, device, iters=1, trials=replays)["median_s"] * 1e6


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = build_engine(args, "dps", max_num_seqs=max(args.batches), kv_bytes=args.kv_bytes)
    try:
        inputs = decode_inputs(engine, max(args.batches), args.context)
        modes = {"full": frozenset(), "fast": frozenset(range(engine.model.config.num_hidden_layers))}
        rows = []
        for batch in args.batches:
            row: dict[str, Any] = {"batch": batch}
            for name, layers in modes.items():
                engine.runner.set_fast_layers(layers)
                fn, padded = decode_step_fn(engine.runner, first_rows(inputs, batch))
                row[name] = kernel_times(fn, engine.device, args.replays)
                row["padded_batch"] = padded
            rows.append(row)
        engine.runner.set_fast_layers(frozenset())
        return {"steps": rows}
    finally:
        engine.close()


def format_report(result: dict[str, Any]) -> str:
    lines = []
    for row in result["steps"]:
        full, fast = row["full"], row["fast"]
        lines.append(f"batch {row['batch']} (graph {row['padded_batch']}): full {full['total_us']:.0f} us, fast "
                     f"{fast['total_us']:.0f} us of kernel time per step ({full['total_us'] / fast['total_us']:.2f}x); "
                     f"wall full {full['wall_us']:.0f} us, fast {fast['wall_us']:.0f} us "
                     f"({full['wall_us'] / fast['wall_us']:.2f}x)")
        names = sorted(set(full["families_us"]) | set(fast["families_us"]),
                       key=lambda n: -full["families_us"].get(n, 0.0) - fast["families_us"].get(n, 0.0))
        for name in names:
            a, b = full["families_us"].get(name, 0.0), fast["families_us"].get(name, 0.0)
            lines.append(f"  {name:38s} full {a:9.1f} us   fast {b:9.1f} us   saved {a - b:9.1f} us")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batch", dest="batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--kv-gib", type=float, default=4.0)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--cpu-kv-blocks", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.batches = sorted(set(args.batches))
    args.kv_bytes = int(args.kv_gib * GIB) if args.device == "cuda" else None
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        args.model_dir = resolve_model(args.model, Path(workdir))
        result = {"metadata": metadata(args), **run(args)}
    result["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_report(result))
    print(f"results: {args.out} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
