"""The longest host gaps between a bench run's steps, with the collector's seconds in each (``gc_s``).

A step's timeline record is taken after it ends (``t``) and holds its device-inclusive time (``step_s``), so the host
time before step i is ``t[i] - step_s[i] - t[i-1]``. ``gc_s`` covers the collector's passes since the step before
ended, between the steps and inside this one (inside it they overlap the device when the engine runs them in its
shadow, ``EngineConfig.gc_in_step_shadow``).

    python benchmarks/serving/step_gaps.py RESULT.json.gz [more ...] [--top 8]
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from pathlib import Path


def step_gaps(timeline: list[dict]) -> list[dict]:
    rows = []
    for before, step in itertools.pairwise(timeline):
        if "step_s" not in step or step.get("steps", 0) == before.get("steps", 0):
            continue
        host_s = step["t"] - step["step_s"] - before["t"]
        rows.append({"t": step["t"], "host_s": host_s, "step_s": step["step_s"], "gc_s": step.get("gc_s"),
                     "running": step.get("running"), "step_tokens": step.get("step_tokens")})
    return rows


def _load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args(argv)
    for path in args.results:
        for run in _load(path)["runs"]:
            rows = step_gaps(run.get("timeline", []))
            if not rows:
                continue
            hosts = sorted(r["host_s"] for r in rows)
            gcs = [r["gc_s"] for r in rows if r["gc_s"] is not None]
            summary = run.get("summary", {})
            p99 = hosts[int(0.99 * (len(hosts) - 1))]
            print(f"{path.name} {run['policy']} @ {run.get('rate') or run.get('concurrency')}: {len(rows)} steps, "
                  f"host p50 {statistics.median(hosts) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max "
                  f"{hosts[-1] * 1e3:.1f} ms; gc total {sum(gcs) * 1e3:.1f} ms; attainment "
                  f"{summary.get('attainment', float('nan')):.3f}, tbt_max {summary.get('tbt_max', float('nan')):.4f}"
                  " s")
            for r in sorted(rows, key=lambda r: r["host_s"], reverse=True)[: args.top]:
                gc_ms = "n/a" if r["gc_s"] is None else f"{r['gc_s'] * 1e3:.1f}"
                print(f"  t={r['t']:7.2f} s host {r['host_s'] * 1e3:6.1f} ms  step {r['step_s'] * 1e3:6.1f} ms  "
                      f"gc {gc_ms} ms  running {r['running']}  tokens {r['step_tokens']}")


if __name__ == "__main__":
    main()
