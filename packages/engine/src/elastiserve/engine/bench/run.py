"""Benchmark orchestration: per policy, measure T_base, replay the workload at each rate (or concurrency), summarise,
write one JSON file and the plots. Used by ``elastiserve bench`` and importable."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastiserve.engine.bench import plots
from elastiserve.engine.bench.http_replay import replay_http
from elastiserve.engine.bench.replay import ReplayResult, measure_t_base, replay_in_process
from elastiserve.engine.bench.results import capacity, clean_json, per_request, run_metadata, summarize, write_json
from elastiserve.engine.bench.workload import WorkloadSpec, build_requests, make_prompts
from elastiserve.engine.protocol import eos_token_ids
from elastiserve.engine.server import engine_limits


@dataclass
class BenchPlan:
    workload: WorkloadSpec
    policies: tuple[str, ...] = ("static-fp16",)
    rates: tuple[float, ...] = ()  # a rate sweep (overrides the workload's rate), or empty: the workload as given
    concurrencies: tuple[int, ...] = ()  # a closed-loop concurrency sweep
    out_dir: Path = Path("bench-results")
    plots: bool = True
    progress: bool = True
    t_base: float | None = None  # None: measured per policy in the same run
    max_duration_s: float | None = None
    tag: str = "bench"
    settings: dict[str, Any] = field(default_factory=dict)  # engine settings, recorded in the JSON

    def points(self) -> list[tuple[float | None, int | None]]:
        if self.concurrencies:
            return [(None, c) for c in self.concurrencies]
        return [(r, None) for r in self.rates] or [(self.workload.rate, None)]


def _run_point(plan: BenchPlan, replay: Callable[..., ReplayResult], rate: float | None, concurrency: int | None,
               vocab: int, avoid: frozenset[int]) -> tuple[ReplayResult, list]:
    # A swept rate replaces the workload's arrivals (for a trace: Gamma(cv) arrivals over its lengths).
    spec = plan.workload.with_rate(rate) if rate is not None else plan.workload
    requests = build_requests(spec)
    prompts = make_prompts(requests, vocab, avoid=avoid, seed=spec.seed, shared_prefix=spec.shared_prefix)
    return replay(requests, prompts, concurrency), requests


def run_bench(plan: BenchPlan, *, engine_factory: Callable[[str], Any] | None = None,
              url: str | None = None, model: str = "model", api_key: str | None = None,
              vocab_size: int | None = None) -> dict[str, Any]:
    """In-process when ``engine_factory(policy)`` is given, else over HTTP against ``url`` (the server's policy)."""
    if (engine_factory is None) == (url is None):
        raise ValueError("give exactly one of engine_factory (in-process) or url (HTTP)")
    out: dict[str, Any] = {"metadata": run_metadata(model=model, settings={
        "plan": {k: v for k, v in asdict(plan).items() if k != "settings"}, "engine": plan.settings,
        "mode": "in-process" if engine_factory else "http", "url": url}), "runs": [], "capacity": {}, "plots": []}
    sweeps: dict[str, list[dict[str, Any]]] = {}
    timelines: dict[str, ReplayResult] = {}
    for policy in plan.policies:
        if engine_factory is not None:
            engine = engine_factory(policy)
            vocab = engine_limits(engine, getattr(engine, "tokenizer", None))[1]
            avoid = eos_token_ids(getattr(engine, "tokenizer", None), engine)
            t_base = plan.t_base or measure_t_base(engine, vocab, avoid=avoid)

            def replay(requests, prompts, concurrency, engine=engine, policy=policy):
                return replay_in_process(engine, requests, prompts, concurrency=concurrency,
                                         max_duration_s=plan.max_duration_s, progress=plan.progress, desc=policy)
        else:
            engine, vocab, avoid = None, vocab_size or 32000, frozenset()

            def replay(requests, prompts, concurrency):
                return asyncio.run(replay_http(url, model, requests, prompts, api_key=api_key,
                                               concurrency=concurrency, progress=plan.progress))
            t_base = plan.t_base or _http_t_base(replay, vocab)
        for rate, concurrency in plan.points():
            result, _ = _run_point(plan, replay, rate, concurrency, vocab, avoid)
            summary = summarize(result, t_base, name=policy, rate=rate)
            summary["concurrency"] = concurrency
            sweeps.setdefault(policy, []).append(summary)
            timelines[policy] = result  # the last (highest) point is the timeline's
            append_point(plan.out_dir / f"{plan.tag}.points.jsonl", policy, rate, concurrency, summary)
            out["runs"].append({"policy": policy, "rate": rate, "concurrency": concurrency, "summary": summary,
                                "requests": per_request(result.records, t_base), "events": result.events,
                                "timeline": result.samples,
                                "stats_before": result.stats_before, "stats_after": result.stats_after,
                                "settle_s": result.settle_s})
        out["capacity"][policy] = capacity(sweeps[policy])
        if engine is not None:
            engine.close()  # the next policy's engine needs its memory (closing twice is a no-op)
        del engine
        gc.collect()
    if plan.plots:
        out["plots"] = _plots(plan, sweeps, timelines)
    out["json"] = str(write_json(plan.out_dir / f"{plan.tag}.json", out))
    return out


def append_point(path: Path, policy: str, rate: float | None, concurrency: int | None,
                 summary: dict[str, Any]) -> None:
    """One line per finished point, written as it finishes: a run cut before its JSON (a GPU call's time limit took
    session 9's dps MoE run whole) keeps its points; ``points_output`` reads them back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"policy": policy, "rate": rate, "concurrency": concurrency, "summary": summary}
    with path.open("a") as f:
        f.write(json.dumps(clean_json(line), allow_nan=False) + "\n")


def points_output(path: Path) -> dict[str, Any]:
    """A ``run_bench`` result (runs and capacity, no per-request detail) from a points file."""
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    sweeps: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        sweeps.setdefault(run["policy"], []).append(run["summary"])
    return {"runs": runs, "capacity": {policy: capacity(s) for policy, s in sweeps.items()}, "json": str(path)}


def _http_t_base(replay: Callable[..., ReplayResult], vocab: int) -> float:
    from elastiserve.control.workloads import Request

    solo = [Request(0, 0.0, 32, 16)]
    return replay(solo, make_prompts(solo, vocab, seed=12345), None).records[0].tpot


def _plots(plan: BenchPlan, sweeps: dict[str, list[dict[str, Any]]], timelines: dict[str, ReplayResult]) -> list[str]:
    paths = []
    if any(s["rate"] is not None for runs in sweeps.values() for s in runs):
        paths.append(plots.plot_rate_sweep(sweeps, plan.out_dir / f"{plan.tag}_rate_sweep.png", title=plan.tag))
    paths.append(plots.plot_timeline(timelines, plan.out_dir / f"{plan.tag}_timeline.png", title=plan.tag))
    return [str(p) for p in paths]
