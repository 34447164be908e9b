"""Prefix caching side by side: the same shared-prefix workload through one engine without and one with
``enable_prefix_caching``, in one process, in that order.

Every prompt opens with the same ``--shared-prefix`` tokens (a system prompt) and goes on with its own; requests
arrive at ``--rate`` (Poisson). Printed per engine: mean and P90 TTFT, output tokens per second, and the prompt
tokens the cache served.

    python benchmarks/engine/bench_prefix_cache.py --device cpu --model smollm2 --requests 16 --input-len 384 \\
        --shared-prefix 320 --output-len 8 --rate 2 --out prefix-cache.json
    python benchmarks/engine/bench_prefix_cache.py --model llama-3.1-8b --load-format dummy --requests 200 ...
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from decode_setup import free_device_memory, metadata, resolve_model

from elastiserve.engine.bench.replay import replay_in_process
from elastiserve.engine.bench.results import summarize
from elastiserve.engine.bench.workload import WorkloadSpec, build_requests, make_prompts
from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine


def run(args: argparse.Namespace, caching: bool) -> dict[str, Any]:
    config = EngineConfig(model=args.model_dir, policy=args.policy, device=args.device, load_format=args.load_format,
                          max_num_batched_tokens=args.max_num_batched_tokens, cpu_kv_blocks=args.cpu_kv_blocks,
                          enable_prefix_caching=caching, seed=0)
    engine = LLMEngine(config, eos_token_ids=())
    try:
        spec = WorkloadSpec(kind="fixed", rate=args.rate, cv=1.0, num_requests=args.requests,
                            input_len=args.input_len, output_len=args.output_len, shared_prefix=args.shared_prefix)
        requests = build_requests(spec)
        vocab = engine.model.config.vocab_size
        prompts = make_prompts(requests, vocab, seed=spec.seed, shared_prefix=spec.shared_prefix)
        result = replay_in_process(engine, requests, prompts, progress=False, desc=f"caching={caching}")
        summary = summarize(result, t_base=1.0, name=f"caching={caching}", rate=args.rate)
        stats = engine.stats()
        return {"prefix_caching": caching, "ttft_mean": summary["ttft_mean"], "ttft_p90": summary["ttft_p90"],
                "tpot_mean": summary["tpot_mean"], "output_tokens_per_s": summary["output_tokens_per_s"],
                "duration_s": summary["duration_s"], "finished": summary["finished"],
                "prompt_tokens": sum(r.prompt_tokens for r in requests),
                "cache_hit_tokens": stats.get("prefix_cache_hit_tokens", 0)}
    finally:
        engine.close()
        del engine
        free_device_memory()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a model name or directory, or a config dict (JSON text)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--policy", default="static-fp16")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=384)
    p.add_argument("--shared-prefix", type=int, default=320)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cpu-kv-blocks", type=int, default=1024)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        args.model_dir = resolve_model(args.model, Path(workdir))
        rows = [run(args, caching) for caching in (False, True)]
    off, on = rows
    for row in rows:
        print(f"prefix caching {'on ' if row['prefix_caching'] else 'off'}: TTFT mean {row['ttft_mean']:.3f} s, "
              f"P90 {row['ttft_p90']:.3f} s; {row['output_tokens_per_s']:.1f} output tok/s; "
              f"{row['cache_hit_tokens']} of {row['prompt_tokens']} prompt tokens from the cache", flush=True)
    print(f"mean TTFT off / on: {off['ttft_mean'] / on['ttft_mean']:.2f}x")
    args.out.write_text(json.dumps({"metadata": metadata(args), "runs": rows}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
