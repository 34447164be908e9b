"""TTFT of a closed-loop run split into its first wave and the rest, per policy.

With every request ready at t=0 and a closed-loop client at concurrency C, the first C requests start together and
queue behind each other's prefill (at full dense size 38 x 4,096 tokens, ~4.4 s on an H100), whatever the policy.
Over a short run that wave is a large share of the requests and sets P90 (session 44, 160 requests: 24 %); over
the headline's 600 it is 6 %. This prints mean / P50 / P90 TTFT over all requests, over the first wave (the C
earliest arrivals) and over the rest, so a short run's ratios can be read apart from the wave every policy pays.

    python benchmarks/serving/ttft_waves.py benchmarks/serving/results/dense-one-gpu-s44/full-160/dense-*.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from elastiserve.control.metrics import mean, percentile


def _load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def wave_split(requests: list[dict], concurrency: int) -> dict[str, list[float]]:
    """TTFTs of finished requests: all, the first ``concurrency`` by arrival, and the rest."""
    ordered = sorted(requests, key=lambda r: r["arrival"])
    first = [r["ttft"] for r in ordered[:concurrency] if r.get("ttft") is not None]
    rest = [r["ttft"] for r in ordered[concurrency:] if r.get("ttft") is not None]
    return {"all": first + rest, "first wave": first, "rest": rest}


def rows(runs: list[dict]) -> list[str]:
    out = [f"{'policy':>12} {'conc':>4} {'part':>10} {'n':>4} {'mean':>7} {'P50':>7} {'P90':>7}"]
    for run in runs:
        concurrency = run.get("concurrency")
        if not concurrency:
            continue  # an open-loop (rate) point has no waves
        for part, ttfts in wave_split(run["requests"], concurrency).items():
            out.append(f"{run['policy']:>12} {concurrency:>4} {part:>10} {len(ttfts):>4} {mean(ttfts):>6.2f}s "
                       f"{percentile(ttfts, 50):>6.2f}s {percentile(ttfts, 90):>6.2f}s")
    return out


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="headline.py per-policy JSON files (.json or .json.gz)")
    args = p.parse_args(argv)
    table = "\n".join(rows([run for path in args.results for run in _load(path)["runs"]]))
    print(table)
    return table


if __name__ == "__main__":
    main()
