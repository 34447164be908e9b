"""``elastiserve bench`` arguments and their translation into a `BenchPlan`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastiserve.engine.bench.workload import KINDS, WorkloadSpec

POLICIES = ("static-fp16", "static-fp8", "dps", "elastickv", "combined")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="model for in-process runs (the server's name with --url)")
    p.add_argument("--url", default=None, help="benchmark a running server over HTTP instead of in-process")
    p.add_argument("--api-key", default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="HTTP mode: random prompt ids are drawn below this")
    p.add_argument("--policies", dest="policies", action="append", choices=POLICIES, default=None,
                   help="in-process: one engine per policy (repeat the flag); default: --policy")
    p.add_argument("--workload", default="trace", choices=KINDS)
    p.add_argument("--trace", default="azure-window", help="trace or length-table name (elastiserve.control)")
    p.add_argument("--trace-dir", type=Path, default=None)
    p.add_argument("--start", type=int, default=0, help="trace window: first row")
    p.add_argument("--count", type=int, default=32, help="trace window: number of rows")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply trace inter-arrival times (1/200: 200x)")
    p.add_argument("--num-requests", type=int, default=32, help="fixed workloads")
    p.add_argument("--input-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--max-prompt", type=int, default=None, help="clip prompt lengths")
    p.add_argument("--max-output", type=int, default=None, help="clip output lengths")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="every prompt starts with the same this many tokens (a system prompt; see "
                        "--enable-prefix-caching)")
    p.add_argument("--rate", dest="rates", type=float, action="append", default=None,
                   help="request rate (req/s); repeat for a sweep")
    p.add_argument("--cv", type=float, default=2.0, help="coefficient of variation of Gamma arrivals")
    p.add_argument("--concurrency", dest="concurrencies", type=int, action="append", default=None,
                   help="closed-loop concurrency; repeat for a sweep")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--t-base", type=float, default=None, help="seconds; default: measured in the same run")
    p.add_argument("--max-duration", type=float, default=None, help="stop a replay after this many seconds")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--tag", default="bench")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def plan_from_args(args: argparse.Namespace, engine_settings: dict[str, Any]):
    from elastiserve.engine.bench.run import BenchPlan

    rates = tuple(args.rates or ())
    spec = WorkloadSpec(kind=args.workload, trace=args.trace, start=args.start, count=args.count,
                        time_scale=args.time_scale, rate=rates[0] if rates else None, cv=args.cv,
                        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
                        max_prompt=args.max_prompt, max_output=args.max_output,
                        shared_prefix=args.shared_prefix, seed=args.workload_seed,
                        trace_dir=args.trace_dir)
    policies = tuple(args.policies or [getattr(args, "policy", "static-fp16")])
    return BenchPlan(spec, policies=policies, rates=rates,
                     concurrencies=tuple(args.concurrencies or ()), out_dir=args.out, plots=not args.no_plots,
                     progress=not args.no_progress, t_base=args.t_base, max_duration_s=args.max_duration,
                     tag=args.tag, settings=engine_settings)


def run_from_args(args: argparse.Namespace, make_engine: Callable[[str, str, dict[str, Any]], Any],
                  engine_settings: dict[str, Any]) -> int:
    from elastiserve.engine.bench.run import run_bench

    plan = plan_from_args(args, engine_settings)
    if args.url:
        out = run_bench(plan, url=args.url.rstrip("/"), model=args.model or "model", api_key=args.api_key,
                        vocab_size=args.vocab_size)
    else:
        if not args.model:
            raise SystemExit("elastiserve bench: give a MODEL for in-process runs, or --url for a server")
        out = run_bench(plan, engine_factory=lambda policy: make_engine(args.model, policy, engine_settings),
                        model=args.model)
    rows = [{"policy": r["policy"], "rate": r["rate"], "concurrency": r["concurrency"],
             **{k: r["summary"][k] for k in ("attainment", "eff300", "ttft_mean", "tpot_mean", "achieved_rate",
                                             "preemptions", "base_exposure", "fast_fraction")}} for r in out["runs"]]
    print(json.dumps({"json": out["json"], "plots": out["plots"], "capacity": out["capacity"], "runs": rows},
                     indent=1, default=str))
    return 0
