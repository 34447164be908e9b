"""The longest host gaps between a bench run's steps, with the collector's seconds in each (``gc_s``).

A step's timeline record is taken after it ends (``t``) and holds its device-inclusive time (``step_s``), so the host
time before step i is ``t[i] - step_s[i] - t[i-1]``. ``gc_s`` covers the collector's passes since the step before
ended, between the steps and inside this one (inside it they overlap the device when the engine runs them in its
shadow, ``EngineConfig.gc_in_step_shadow``).

    python benchmarks/serving/step_gaps.py RESULT.json.gz [more ...] [--top 8] [--by-running 8]

``--by-running W`` adds the median host time of decode-only steps that demoted nothing, by running sequences in
buckets of W: host work grows with the batch, so policies compare at equal batches (session 47: elastickv 2.21 ms at
56 sequences, dps 0.95 ms at 48-55, where static-fp16, preempting, ran 24-39).
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
                     "running": step.get("running"), "step_tokens": step.get("step_tokens"),
                     "step_seqs": step.get("step_seqs"),
                     "demoted": step.get("demotions", 0) - before.get("demotions", 0)})
    return rows


def host_by_running(rows: list[dict], width: int) -> list[tuple[int, int, float]]:
    """(lowest running count of the bucket, steps, median host ms) over decode-only steps that demoted nothing."""
    buckets: dict[int, list[float]] = {}
    for r in rows:
        if r["step_tokens"] != r["step_seqs"] or r["demoted"] or r["running"] is None:
            continue
        buckets.setdefault(r["running"] // width * width, []).append(r["host_s"] * 1e3)
    return [(low, len(ms), statistics.median(ms)) for low, ms in sorted(buckets.items())]


def _load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--by-running", type=int, default=None, metavar="W",
                   help="also the median host ms of decode-only, non-demoting steps by running sequences, W a bucket")
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
            if args.by_running:
                for low, n, median_ms in host_by_running(rows, args.by_running):
                    print(f"  running {low}-{low + args.by_running - 1}: {n} decode steps, host median "
                          f"{median_ms:.2f} ms")


if __name__ == "__main__":
    main()
