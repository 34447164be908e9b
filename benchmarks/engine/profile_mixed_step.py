"""Where a step that carries a prefill chunk spends its time: host launch work against device work, per policy.

Session 7's MoE headline at 1,024-token chunks took ~90 ms per step whatever the chunk, against 43 ms with 2,048:
steps that carry a chunk run eagerly (no CUDA graph), so a fixed host cost per step would explain it. This script
builds an engine with random weights, starts a steady decode batch, and then, per repeat, adds one request whose
prompt is exactly one chunk and times the step that prefills it beside a decode-only step:

* ``wall``: ``engine.step()`` wall time (it ends on the sampled tokens' read-back, so it includes the device work);
* under ``torch.profiler``: the summed device time of the step's kernels, their count, and the host time of the
  top operators. Host-bound steps show a device time well under the wall time.

    python benchmarks/engine/profile_mixed_step.py --model qwen3-30b-a3b --policies static-fp16 dps \\
        --gpu-memory-budget 80e9 --batch 64 --context 1024 --chunk 512 1024 2048 --out mixed.json
    python benchmarks/engine/profile_mixed_step.py --device cpu --model '{...tiny config...}' --batch 2 ...
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from decode_setup import free_device_memory, metadata, prompt_ids, resolve_model, start_decoding

from elastiserve.engine.config import POLICIES, EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams


def build(args: argparse.Namespace, policy: str) -> LLMEngine:
    settings: dict[str, Any] = {"max_num_batched_tokens": max(args.chunk) + args.batch}
    if args.gpu_memory_budget:
        settings["gpu_memory_budget"] = int(args.gpu_memory_budget)
    if args.mixed_graphs:  # capture at first use: each chunk's untimed first step captures its graph
        settings.update(mixed_graphs=True, graph_capture_after=1)
    config = EngineConfig(model=args.model_dir, policy=policy, device=args.device, load_format="dummy",
                          max_num_seqs=args.batch + (args.repeats + 1) * len(args.chunk) + 1,
                          max_model_len=args.max_model_len, cpu_kv_blocks=args.cpu_kv_blocks, seed=0, **settings)
    return LLMEngine(config, eos_token_ids=())


def profiled(step, device: torch.device) -> dict[str, Any]:
    """One call of ``step`` under torch.profiler: device kernel time and count, top host operators."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    # Only the device-side rows (kernels, memcpy, memset): a host operator's row can also carry the device time of
    # the kernels it launched. Session 7's first run summed every row and got 155 ms of "device time" for a
    # 2,048-token chunk whose step took 86 ms of wall time (147 ms under the profiler).
    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in on_device)
    kernels = sum(e.count for e in on_device)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"wall_under_profiler_s": wall, "device_kernel_s": device_us / 1e6, "device_kernels": kernels,
            "top_host_ops": [{"name": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3}
                             for e in top]}


def profile_policy(args: argparse.Namespace, policy: str) -> list[dict[str, Any]]:
    engine = build(args, policy)
    device = torch.device(args.device)
    start_decoding(engine, args.batch, args.context, (2 * args.repeats + 1) * len(args.chunk) + 16,
                   tag=f"{policy}-decode")
    rng = random.Random(17)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    rows = []
    for chunk in args.chunk:
        decode_wall, mixed_wall, mixed_profiles = [], [], []
        engine.add_request(f"{policy}-chunk{chunk}-warm", prompt_ids(engine.vocab_size, chunk, rng), params)
        engine.step()  # untimed: a compile or a graph capture at this shape's first use is not the step's cost
        for i in range(args.repeats):
            t0 = time.perf_counter()
            engine.step()
            decode_wall.append(time.perf_counter() - t0)
            engine.add_request(f"{policy}-chunk{chunk}-{i}", prompt_ids(engine.vocab_size, chunk, rng), params)
            if i % 2:
                mixed_profiles.append(profiled(engine.step, device))
            else:
                t0 = time.perf_counter()
                engine.step()
                mixed_wall.append(time.perf_counter() - t0)
        row = {"policy": policy, "batch": args.batch, "context": args.context, "chunk": chunk,
               "decode_step_median_s": statistics.median(decode_wall),
               "mixed_step_median_s": statistics.median(mixed_wall), "mixed_profiles": mixed_profiles}
        decode_ms, mixed_ms = 1e3 * row["decode_step_median_s"], 1e3 * row["mixed_step_median_s"]
        device_ms = 1e3 * statistics.median(p["device_kernel_s"] for p in mixed_profiles)
        print(f"{policy:12s} chunk {chunk:5d}  decode {decode_ms:7.1f} ms  mixed {mixed_ms:7.1f} ms  mixed device "
              f"{device_ms:7.1f} ms in {mixed_profiles[0]['device_kernels']} kernels", flush=True)
        rows.append(row)
    rows[-1]["decode_profile"] = profiled(engine.step, device)
    engine.close()
    del engine
    if device.type == "cuda":
        free_device_memory()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--policies", nargs="+", default=["static-fp16", "dps"], choices=POLICIES)
    p.add_argument("--gpu-memory-budget", type=float, default=None)
    p.add_argument("--batch", type=int, default=64, help="decode sequences in every step")
    p.add_argument("--context", type=int, default=1024, help="their prompt tokens")
    p.add_argument("--chunk", type=int, nargs="+", default=[512, 1024, 2048],
                   help="prompt tokens of each added request (one chunk); one row per value")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--mixed-graphs", action="store_true", help="replay mixed steps from CUDA graphs (graphs.py)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--cpu-kv-blocks", type=int, default=4096)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("--repeats must be >= 2 (timed and profiled mixed steps alternate)")
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = resolve_model(args.model, Path(tmp))
        rows = [row for policy in args.policies for row in profile_policy(args, policy)]
    Path(args.out).write_text(json.dumps({"metadata": metadata(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
