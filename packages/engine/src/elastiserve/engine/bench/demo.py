"""``elastiserve demo``: SmolLM2-135M on the CPU replays a small window of the bundled Azure conversation trace once
per policy and prints one table side by side (plus JSON and plots under ``out_dir``).

The window is small and the outputs short so the whole demo takes a few minutes on 2 CPU cores; the KV pool is a few
blocks smaller than the window's peak demand, so static FP16 must queue or preempt while the elastic policies
demote KV pairs or take weight residual units.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from elastiserve.control.metrics import format_table

POLICIES = ("static-fp16", "static-fp8", "dps", "elastickv", "combined")


@dataclass(frozen=True)
class DemoSettings:
    trace: str = "azure-window"
    start: int = 0
    count: int = 12
    time_scale: float = 0.1  # compress the trace's inter-arrival times 10x: twelve requests within about 1.5 s
    max_prompt: int = 64
    max_output: int = 16
    # 4-token blocks make 8-token pairs, so short prompts already have middle pairs that ElasticKV may demote
    # (one sink pair and two recent pairs always stay TARGET).
    block_size: int = 4
    kv_blocks: int = 48  # 192 tokens of KV: a fifth of the window's peak demand (~240 blocks)
    max_num_seqs: int = 8
    max_model_len: int = 512


def _row(summary: dict, wall_s: float) -> dict[str, str]:
    pct = lambda x: "-" if x is None or x != x else f"{100 * x:.0f}%"  # noqa: E731
    secs = lambda x: "-" if x is None or x != x else f"{x:.2f}s"  # noqa: E731
    return {
        "policy": summary["name"],
        "done": f"{summary['finished']}/{summary['requests']}",
        "SLO attain": pct(summary["attainment"]),
        "Eff@300": pct(summary["eff300"]),
        "TTFT p50": secs(summary["ttft_p50"]),
        "TTFT p90": secs(summary["ttft_p90"]),
        "TPOT": f"{1000 * summary['tpot_mean']:.0f}ms" if summary["tpot_mean"] == summary["tpot_mean"] else "-",
        "preempt": str(summary["preemptions"]),
        "BASE exp": pct(summary["base_exposure"]),
        "fast time": pct(summary["fast_fraction"]),
        "demote/promote": f"{summary['demoted_pairs']}/{summary['promoted_pairs']}",
        "evict": str(summary["evicted_residuals"]),
        "wall": f"{wall_s:.0f}s",
    }


def run_demo(out_dir: Path, *, count: int | None = None, policies: tuple[str, ...] = POLICIES,
             settings: DemoSettings | None = None, progress: bool = True) -> str:
    """Run every policy on the demo window; returns the table (also written to ``out_dir/demo.txt``)."""
    from elastiserve.engine.bench.run import BenchPlan, run_bench
    from elastiserve.engine.bench.workload import WorkloadSpec
    from elastiserve.engine.cli import make_engine

    s = settings or DemoSettings()
    spec = WorkloadSpec(kind="trace", trace=s.trace, start=s.start, count=count or s.count, time_scale=s.time_scale,
                        max_prompt=s.max_prompt, max_output=s.max_output)
    engine_settings = {"device": "cpu", "block_size": s.block_size, "max_num_seqs": s.max_num_seqs,
                       "max_model_len": s.max_model_len, "cpu_kv_blocks": s.kv_blocks}
    plan = BenchPlan(spec, policies=policies, out_dir=Path(out_dir), progress=progress, tag="demo",
                     settings=engine_settings)
    walls: dict[str, float] = {}

    def factory(policy: str):
        walls[policy] = time.monotonic()
        return make_engine("smollm2", policy, engine_settings)

    out = run_bench(plan, engine_factory=factory, model="smollm2")
    rows = []
    for i, run in enumerate(out["runs"]):
        nxt = out["runs"][i + 1]["policy"] if i + 1 < len(out["runs"]) else None
        wall = (walls[nxt] if nxt else time.monotonic()) - walls[run["policy"]]
        rows.append(_row(run["summary"], wall))
    table = format_table(rows)
    text = (f"SmolLM2-135M-Instruct on the CPU, {spec.count} requests of the Azure conversation trace "
            f"(time x{s.time_scale}, prompts <= {s.max_prompt}, outputs <= {s.max_output} tokens), "
            f"KV pool {s.kv_blocks} blocks of {s.block_size} tokens\n{table}\n"
            f"results: {out['json']}\nplots: {', '.join(out['plots'])}")
    (Path(out_dir) / "demo.txt").write_text(text + "\n")
    return text
