"""Host work of one engine decode step, per policy, with the model forward replaced by a zero tensor: what is timed
is what the CPU does between two GPU steps (policy observation and decisions, scheduling, input gathering and the
buffer fill, logits and sampling on a tiny vocabulary, output bookkeeping). On a GPU this time is not overlapped
with the forward, so it adds to every step.

    python benchmarks/engine/bench_host_overhead.py --out host.json [--batch 64] [--context 1000] [--steps 200]

Runs on the CPU (random tiny Llama weights, ``load_format="dummy"``); each policy in a fresh engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from elastiserve.engine.bench.results import git_commit
from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.runner import ModelRunner
from elastiserve.engine.sampling import SamplingParams

POLICIES = ("static-fp16", "static-fp8", "dps", "elastickv", "combined")
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 211, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "float16"}


def stub_forward(runner: ModelRunner, num_tokens: int, metadata) -> torch.Tensor:
    return torch.zeros(num_tokens, runner.model.config.hidden_size, dtype=runner.model.embed_tokens.weight.dtype)


def hold_base(engine: LLMEngine) -> None:
    """The policy still observes and decides each step, but promotions are dropped, so the BASE share stays put."""
    decide = engine.policy.decide_recovery
    engine.policy.decide_recovery = lambda obs: dataclasses.replace(decide(obs), promote_pairs=0)


def measure(model_dir: str, policy: str, args: argparse.Namespace) -> dict:
    config = EngineConfig(model=model_dir, policy=policy, device="cpu", load_format="dummy", block_size=16,
                          max_num_seqs=args.batch, max_num_batched_tokens=max(8192, args.batch * args.context),
                          cpu_kv_blocks=args.kv_blocks, enforce_eager=True, kv_cache_budget=1 << 30, seed=0)
    engine = LLMEngine(config, eos_token_ids=())
    try:
        rng = random.Random(0)
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 20, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request(f"r{i}", [rng.randrange(200) for _ in range(args.context)], params)
        for _ in range(5):  # prefill, then a few decode steps
            engine.step()
        demotes = engine.config.uses_kv_demotion
        if demotes:
            hold_base(engine)
            eligible = sum(engine.kv.num_demotable_pairs(s) for s in engine.scheduler.running)
            engine.demote(int(args.base_fraction * eligible))
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            if demotes and args.demote_per_step:
                engine.demote(args.demote_per_step)
            engine.step()
            times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    times.sort()
    return {"policy": policy, "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * times[int(0.9 * len(times))], "steps": len(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1000, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--base-fraction", type=float, default=0.0, help="share of demotable pairs demoted before timing")
    p.add_argument("--demote-per-step", type=int, default=0, help="pairs demoted inside every timed step")
    p.add_argument("--kv-blocks", type=int, default=4096, help="KV pool blocks (the CPU pool's size)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ModelRunner.forward = stub_forward
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        (Path(workdir) / "config.json").write_text(json.dumps(TINY_LLAMA))
        for policy in args.policies:
            rows.append(measure(workdir, policy, args))
            print(f"{policy:12s} host time per decode step, batch {args.batch}: median {rows[-1]['median_ms']:.3f} ms"
                  f", p90 {rows[-1]['p90_ms']:.3f} ms", flush=True)
    result = {"commit": git_commit(Path(__file__).resolve().parent), "batch": args.batch, "context": args.context,
              "base_fraction": args.base_fraction, "demote_per_step": args.demote_per_step,
              "python": sys.version.split()[0], "torch": torch.__version__, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
