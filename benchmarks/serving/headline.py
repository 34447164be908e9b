"""Issue 6 headline runs, in-process through the bench harness (`elastiserve.engine.bench`), random weights.

dense:   Llama-3.1-8B shapes, a 20 GB KV pool (``kv_cache_budget``), 600 requests of 4096 prompt / 1024 output tokens,
         closed-loop concurrency sweep 64 / 128 / 256, every policy side by side: preemptions, mean / P90 TTFT, TPOT,
         BASE exposure, time in FP8 (fast) mode; T_base as for moe, at batch min(32, highest concurrency).
moe:     Qwen3-30B-A3B shapes, an 80 GB GPU-memory budget (``gpu_memory_budget``), Azure-conversation lengths with
         Gamma CV = 2 arrivals, rate sweep; capacity = the highest rate with >= 90 % joint-SLO attainment, T_base =
         the P99 decode step of batch 32 at 4k context, measured in the same run (on the first policy's engine,
         static-fp16 in the default order; ``--t-base`` passes one from another run).
quality: `elastiserve.engine.bench.quality` (SmolLM2 with ShareGPT answers, every precision variant vs fp16).

Reductions for a short device call: ``--requests N`` (fewer requests), ``--scale s`` (dense: prompt, output and KV
budget x s, so the same number of requests fits at once; moe: prompts clipped to s x 14,050 and outputs to s x 1,000
tokens, the Azure maxima, and the T_base context x s; quality: teacher-forced tokens x s), ``--policies``,
``--concurrency`` / ``--rate`` and ``--max-duration``. The run prints every reduction and records it in the JSON.
Each policy writes ``<setting>-<policy>.json`` under ``--out``; ``--summarize`` prints the side-by-side table of
whatever is there (runs split over several calls).

    python benchmarks/serving/headline.py --setting dense --out results/headline
    python benchmarks/serving/headline.py --setting moe --out results/headline --requests 150 --rate 2 --rate 4
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

POLICIES = ("static-fp16", "static-fp8", "dps", "elastickv", "combined")
AZURE_MAX_PROMPT, AZURE_MAX_OUTPUT = 14050, 1000


@dataclass(frozen=True)
class Setting:
    model: str
    requests: int
    max_model_len: int
    kv_cache_budget: int | None = None
    gpu_memory_budget: int | None = None
    input_len: int = 4096
    output_len: int = 1024
    concurrencies: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()
    trace: str = "azure"
    cv: float = 2.0
    t_base_batch: int = 32
    t_base_context: int = 4096
    max_num_seqs: int = 256
    extra: dict[str, Any] = field(default_factory=dict)


FULL = {
    "dense": Setting("llama-3.1-8b", 600, 8192, kv_cache_budget=20 * 10**9, concurrencies=(64, 128, 256)),
    "moe": Setting("qwen3-30b-a3b", 600, 16384, gpu_memory_budget=80 * 10**9, rates=(1.0, 2.0, 4.0, 6.0, 8.0)),
}


# ---- engines ---------------------------------------------------------------------------------------------------
def resolve_model(spec: str, workdir: Path) -> str:
    """A config dict given as JSON text becomes a directory with config.json (tiny smoke-test models)."""
    if not spec.lstrip().startswith("{"):
        return spec
    model_dir = workdir / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(json.loads(spec)))
    return str(model_dir)


def build_engine(model: str, policy: str, settings: dict[str, Any]):
    from elastiserve.engine.config import EngineConfig
    from elastiserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, policy=policy, load_format="dummy", **settings))


def free_device_memory() -> None:
    """After an engine is closed and its last name dropped (``del``): collect it and hand its cached blocks back. A
    loop variable that still named the closed engine kept Qwen3-30B's 61 GB alive, and the next engine's 80 GB
    budget came out 46 GB short on the H200."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()


QUEUE_SETTLE_STEPS = 400  # most decode steps T_base waits for the queue rule's hold to end


def p99_decode_step(engine, batch: int, context: int, steps: int = 64) -> dict[str, Any]:
    """Wall time of ``steps`` engine steps of a steady decode batch (``batch`` requests of ``context`` tokens)."""
    from elastiserve.engine.sampling import SamplingParams

    rng = random.Random(4096)
    # With --queue-fast-after the prompts' wait turns every layer fast, and the rule holds it for queue_fast_hold_s
    # (2 s by default, ~140 decode steps at 14 ms): T_base is measured after it lets go, on full-precision steps.
    settle = QUEUE_SETTLE_STEPS if engine.config.queue_fast_after_s is not None else 0
    room = engine.max_model_len - steps - 8  # a short max_model_len fits every step
    settle = min(settle, max(0, room - 1))  # ... and keeps a prompt token (the CPU smoke's 128-token models)
    context = min(context, room - settle)
    max_tokens = steps + settle + 8
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"tbase-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(1, engine.vocab_size) for _ in range(context)], params)
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    settled = 0
    while engine.transitions.queue_fast and settled < settle:
        engine.step()
        settled += 1
    preempted = engine.scheduler.num_preemptions
    fast_layers = set()
    samples = []
    for _ in range(min(steps, max_tokens - 2)):
        t0 = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - t0)
        fast_layers |= engine.runner.fast_layers
    for rid in ids:
        engine.abort_request(rid)
    samples.sort()
    p99 = samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))]
    return {"p99_s": p99, "median_s": statistics.median(samples), "steps": len(samples), "batch": batch,
            "context": context, "settle_steps": settled, "preemptions": engine.scheduler.num_preemptions - preempted,
            "layers_in_fast_mode": len(fast_layers)}  # 0: every measured step ran in full precision


# ---- reductions ------------------------------------------------------------------------------------------------
def reduced_setting(name: str, args: argparse.Namespace) -> tuple[Setting, list[str]]:
    full = FULL[name]
    s = args.scale
    cfg = replace(full, requests=args.requests or full.requests,
                  concurrencies=tuple(args.concurrency or full.concurrencies), rates=tuple(args.rate or full.rates),
                  max_model_len=args.max_model_len or full.max_model_len)
    if name == "dense":
        budget = args.kv_budget_bytes or int(full.kv_cache_budget * s)
        cfg = replace(cfg, input_len=max(1, round(full.input_len * s)), output_len=max(1, round(full.output_len * s)),
                      kv_cache_budget=budget, t_base_context=max(1, round(full.t_base_context * s)),
                      t_base_batch=min(full.t_base_batch, max(cfg.concurrencies)))
    else:
        cfg = replace(cfg, t_base_context=max(1, round(full.t_base_context * s)),
                      extra={"max_prompt": max(1, round(AZURE_MAX_PROMPT * s)),
                             "max_output": max(1, round(AZURE_MAX_OUTPUT * s))} if s != 1.0 else {})
    if args.model:
        cfg = replace(cfg, model=args.model)
    if args.max_num_seqs:
        cfg = replace(cfg, max_num_seqs=args.max_num_seqs)
    changes = [f"{k}: {getattr(full, k)} -> {getattr(cfg, k)}" for k in asdict(full)
               if getattr(full, k) != getattr(cfg, k)]
    if tuple(args.policies) != POLICIES:
        changes.append(f"policies: all -> {', '.join(args.policies)}")
    if args.max_duration:
        changes.append(f"each point stops after {args.max_duration:.0f} s")
    if args.max_num_batched_tokens:
        changes.append(f"max_num_batched_tokens: 8192 -> {args.max_num_batched_tokens}")
    return cfg, changes


def engine_settings(cfg: Setting, args: argparse.Namespace) -> dict[str, Any]:
    settings = {"device": args.device, "max_model_len": cfg.max_model_len, "max_num_seqs": cfg.max_num_seqs,
                "cpu_kv_blocks": args.cpu_kv_blocks, "seed": args.seed}
    if args.max_num_batched_tokens:
        settings["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.mixed_graphs:
        settings["mixed_graphs"] = True
    if args.max_step_time:
        settings["max_step_time_s"] = args.max_step_time
    if args.no_gc_shadow:
        settings["gc_in_step_shadow"] = False
    if args.device != "cpu":  # the CPU pool is sized by cpu_kv_blocks
        settings["kv_cache_budget"] = cfg.kv_cache_budget
        settings["gpu_memory_budget"] = cfg.gpu_memory_budget
    return settings


def policy_settings(settings: dict[str, Any], policy: str, args: argparse.Namespace) -> dict[str, Any]:
    """``settings`` plus what only some policies take: ``--queue-fast-after`` and ``--prefill-fast`` for the ones
    that switch precision."""
    from elastiserve.engine.config import SWITCHING_POLICIES

    if policy not in SWITCHING_POLICIES:
        return settings
    if args.queue_fast_after is not None:
        settings = {**settings, "queue_fast_after_s": args.queue_fast_after, "queue_fast_hold_s": args.queue_fast_hold}
    if args.prefill_fast:
        settings = {**settings, "prefill_fast": True}
    return settings


# ---- runs ------------------------------------------------------------------------------------------------------
def workload(name: str, cfg: Setting, args: argparse.Namespace):
    from elastiserve.engine.bench.workload import WorkloadSpec

    if name == "dense":  # closed loop: the rate only orders the arrivals, the concurrency admits them
        return WorkloadSpec(kind="fixed", rate=1.0, num_requests=cfg.requests, input_len=cfg.input_len,
                            output_len=cfg.output_len, seed=args.seed)
    max_output = cfg.extra.get("max_output", AZURE_MAX_OUTPUT)
    max_prompt = min(cfg.extra.get("max_prompt", AZURE_MAX_PROMPT), cfg.max_model_len - max_output)
    return WorkloadSpec(kind="gamma", trace=cfg.trace, count=cfg.requests, rate=cfg.rates[0], cv=cfg.cv,
                        max_prompt=max_prompt, max_output=max_output, seed=args.seed,
                        trace_dir=Path(args.trace_dir) if args.trace_dir else None)


def run_setting(name: str, args: argparse.Namespace, cfg: Setting, model: str) -> list[dict[str, Any]]:
    from elastiserve.engine.bench.run import BenchPlan, run_bench

    settings = engine_settings(cfg, args)
    spec = workload(name, cfg, args)
    outputs, t_base, t_base_info = [], args.t_base, None
    for policy in args.policies:
        engine = build_engine(model, policy, policy_settings(settings, policy, args))
        try:
            if t_base is None:  # one T_base for every policy: the first engine's (static-fp16 in the default order)
                t_base_info = {"policy": policy, **p99_decode_step(engine, cfg.t_base_batch, cfg.t_base_context)}
                t_base = t_base_info["p99_s"]
                print(f"T_base = P99 decode step, batch {cfg.t_base_batch} at {t_base_info['context']} tokens, on the "
                      f"{policy} engine: {1e3 * t_base:.2f} ms", flush=True)
            plan = BenchPlan(spec, policies=(policy,), rates=cfg.rates if name == "moe" else (),
                             concurrencies=cfg.concurrencies if name == "dense" else (), out_dir=args.out,
                             plots=not args.no_plots, progress=not args.no_progress, t_base=t_base,
                             max_duration_s=args.max_duration, tag=f"{name}-{policy}",
                             settings={**policy_settings(settings, policy, args), "load_format": "dummy",
                                       "headline": asdict(cfg),
                                       "t_base_measurement": t_base_info})
            out = run_bench(plan, engine_factory=lambda _policy, engine=engine: engine, model=cfg.model)
        finally:
            engine.close()
            del engine
            free_device_memory()
        outputs.append({**json.loads(Path(out["json"]).read_text()), "json": out["json"]})
    return outputs


def summary_rows(outputs: list[dict[str, Any]]) -> list[dict[str, str]]:
    def ms(x):
        return "-" if x is None else f"{1e3 * x:.0f}ms"

    def sec(x):
        return "-" if x is None else f"{x:.2f}s"

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    rows = []
    for out in outputs:
        for run in out["runs"]:
            s = run["summary"]
            rows.append({"policy": run["policy"], "conc": str(run["concurrency"] or "-"),
                         "rate": "-" if run["rate"] is None else f"{run['rate']:g}",
                         "done": f"{s['finished']}/{s['requests']}", "preempt": str(s["preemptions"]),
                         "TTFT mean": sec(s["ttft_mean"]), "TTFT p90": sec(s["ttft_p90"]), "TPOT": ms(s["tpot_mean"]),
                         "SLO": pct(s["attainment"]), "BASE exp": pct(s["base_exposure"]),
                         "FP8 time": sec(s["time_fast_s"]),
                         "FP8 layer-time": sec(s.get("fp8_layer_time_s")),
                         "tok/s": f"{s['output_tokens_per_s'] or 0:.0f}",
                         "wall": sec(s["duration_s"]),
                         # capacity is a rate sweep's figure: a closed-loop (concurrency) point has none
                         "capacity": "-" if run["rate"] is None else f"{out['capacity'].get(run['policy'], 0) or 0:g}"})
    return rows


def print_table(outputs: list[dict[str, Any]]) -> str:
    from elastiserve.control.metrics import format_table

    text = format_table(summary_rows(outputs)) if outputs else "(no runs)"
    print(text)
    return text


def cut_outputs(out_dir: Path, setting: str, files: list[Path]) -> list[dict[str, Any]]:
    """The finished points of policies whose run was cut before it wrote its JSON (``<tag>.points.jsonl``)."""
    from elastiserve.engine.bench.run import points_output

    written = {f.name.split(".")[0] for f in files}
    return [points_output(f) for f in sorted(out_dir.glob(f"{setting}-*.points.jsonl"))
            if f.name.removesuffix(".points.jsonl") not in written]


def plot_side_by_side(outputs: list[dict[str, Any]], path: Path) -> Path | None:
    """One timeline (KV occupancy, mode, BASE residency, TTFT; the DPS paper's Figure 7) of every policy's first run,
    rebuilt from the per-policy JSON files, so runs made in separate calls still land on one figure."""
    from types import SimpleNamespace

    from elastiserve.engine.bench.plots import plot_timeline
    from elastiserve.engine.bench.replay import ReplayResult

    results = {}
    for out in outputs:
        run = out["runs"][0]
        records = [SimpleNamespace(arrival=r["arrival"], ttft=r["ttft"], token_times=[1] if r["finished"] else [])
                   for r in run["requests"]]
        results[run["policy"]] = ReplayResult(records, run["timeline"], run["events"], run["summary"]["duration_s"])
    return plot_timeline(results, path, title=path.stem) if results else None


def run_quality_setting(args: argparse.Namespace) -> dict[str, Any]:
    from elastiserve.engine.bench.quality import QualityConfig, format_quality, run_quality
    from elastiserve.engine.bench.results import run_metadata, write_json

    tokens = max(64, round(10240 * args.scale))
    cfg = QualityConfig(num_tokens=tokens, seq_len=min(1024, tokens))
    if args.scale != 1.0:
        print(f"REDUCED: teacher-forced tokens 10240 -> {tokens}")
    report = run_quality(cfg, progress=not args.no_progress)
    report["metadata"] = run_metadata(model=cfg.model, settings=asdict(cfg))
    write_json(args.out / "quality.json", report)
    print(format_quality(report))
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setting", choices=("dense", "moe", "quality"), required=True)
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON files and plots")
    p.add_argument("--requests", type=int, default=None, help="fewer requests than the setting's")
    p.add_argument("--scale", type=float, default=1.0, help="shrink lengths (and dense's KV budget) by this factor")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--concurrency", type=int, action="append", default=None, help="dense: repeat for a sweep")
    p.add_argument("--rate", type=float, action="append", default=None, help="moe: req/s, repeat for a sweep")
    p.add_argument("--mixed-graphs", action="store_true",
                   help="steps that carry prefill chunks replay CUDA graphs too (EngineConfig.mixed_graphs)")
    p.add_argument("--max-step-time", type=float, default=None,
                   help="seconds: cap prefill chunks per precision mode to keep steps under it "
                        "(EngineConfig.max_step_time_s; e.g. 0.11 under the joint SLO's 5 x T_base)")
    p.add_argument("--queue-fast-after", type=float, default=None,
                   help="seconds: dps and combined run every layer in FP8 while a request has waited this long for "
                        "its first token (EngineConfig.queue_fast_after_s)")
    p.add_argument("--queue-fast-hold", type=float, default=None,
                   help="seconds: with --queue-fast-after, stay fast this long after the last step that saw a waiting "
                        "request (EngineConfig.queue_fast_hold_s; default 2)")
    p.add_argument("--prefill-fast", action="store_true",
                   help="dps, combined: steps that carry a prefill chunk run every layer in FP8, residuals kept "
                        "(EngineConfig.prefill_fast)")
    p.add_argument("--no-gc-shadow", action="store_true",
                   help="automatic garbage collection (EngineConfig.gc_in_step_shadow=False), as before session 15")
    p.add_argument("--t-base", type=float, default=None, help="seconds; default: measured in this run (moe)")
    p.add_argument("--max-duration", type=float, default=None, help="stop each sweep point after this many seconds")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", default=None, help="override the model: a name, a directory or a config dict as JSON")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="chunked-prefill token budget per step (engine default 8192); a smaller one bounds TBT")
    p.add_argument("--kv-budget-bytes", type=int, default=None, help="dense: override the (scaled) 20 GB KV pool")
    p.add_argument("--cpu-kv-blocks", type=int, default=512)
    p.add_argument("--trace-dir", default=None, help="where azure_llm_2023_conv.csv is (else the bundled window)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--summarize", action="store_true", help="only print the table of the JSON files under --out")
    args = p.parse_args(argv)
    if args.scale <= 0 or args.scale > 1:
        p.error("--scale must be in (0, 1]")
    if args.queue_fast_hold is not None and args.queue_fast_after is None:
        p.error("--queue-fast-hold needs --queue-fast-after")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("elastiserve.engine.runner").setLevel(logging.INFO)  # warm-up and capture times
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny CPU smoke runs: intra-op threads only add spin-wait on a shared machine
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    if args.setting == "quality":
        return run_quality_setting(args)
    if args.summarize:
        files = sorted([*args.out.glob(f"{args.setting}-*.json"), *args.out.glob(f"{args.setting}-*.json.gz")])
        loaded = [(f, json.loads(gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_text()))
                  for f in files]  # committed results are gzipped
        outputs = [{**data, "json": str(f)} for f, data in loaded if "runs" in data]  # not the headline summary
        if not args.no_plots:
            plot_side_by_side(outputs, args.out / f"{args.setting}-timeline.png")
        return {"table": print_table(outputs + cut_outputs(args.out, args.setting, files))}
    cfg, changes = reduced_setting(args.setting, args)
    print("REDUCED: " + "; ".join(changes) if changes else "full setting (nothing reduced)", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        outputs = run_setting(args.setting, args, cfg, resolve_model(cfg.model, Path(workdir)))
    table = print_table(outputs)
    if not args.no_plots:
        plot_side_by_side(outputs, args.out / f"{args.setting}-timeline.png")
    result = {"setting": args.setting, "config": asdict(cfg), "reductions": changes, "table": table,
              "policy_json": [o["json"] for o in outputs], "capacity": {k: v for o in outputs
                                                                         for k, v in o["capacity"].items()},
              "wall_s": time.perf_counter() - t0}
    (args.out / f"headline-{args.setting}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"results: {args.out} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
