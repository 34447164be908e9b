"""Fit the step model's KV-read and demotion coefficients from the decode steps of H200 engine headline runs.

    step = host_overhead + weight_read_unnested + kv_read_per_token x (TARGET tokens + base_read_fraction x BASE)

The intercept is held at the packaged model's (both from measured batch-1 steps); the two coefficients are a least
squares fit over every sample that is one decode-only step (same running and waiting counts on both sides, under
60 ms, so no prefill chunk), with context from the pool's used blocks: TARGET blocks x 16 + BASE pairs x 32 tokens.
The demotion cost per batch is then the median residual of the steps that demoted less that of the steps that did
not, per run, weighted by the number of demoting steps.

    python benchmarks/control/fit_kv_read.py benchmarks/serving/results/dense-full-run2 \
        benchmarks/serving/results/dense-paper-run1
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from pathlib import Path

import numpy as np

from elastiserve.control.step_model import load_step_model

DECODE_STEP_MAX_S = 0.06


def decode_steps(run_dir: Path, block_size: int = 16):
    """(policy, seconds, TARGET tokens, BASE tokens) of every decode-only step in the run's per-policy JSON."""
    for path in sorted([*run_dir.glob("dense-*.json.gz"), *run_dir.glob("dense-*.json")]):
        with (gzip.open(path) if path.suffix == ".gz" else path.open()) as f:
            result = json.load(f)
        for run in result["runs"]:
            samples = run["timeline"]
            for before, after in itertools.pairwise(samples):
                seconds = after["t"] - before["t"]
                same_batch = after["running"] == before["running"] and after["waiting"] == before["waiting"]
                if after["steps"] - before["steps"] != 1 or not same_batch or seconds >= DECODE_STEP_MAX_S:
                    continue
                used = after["total_blocks"] - after["free_blocks"]
                base_pairs = after["base_pairs"]
                demoted = after["demotions"] > before["demotions"]
                yield run["policy"], seconds, (used - base_pairs) * block_size, base_pairs * 2 * block_size, demoted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    model = load_step_model()
    intercept = model.host_overhead_s + model.weight_read_unnested_s
    by_run = {run: list(decode_steps(run)) for run in args.runs}
    rows = [row for run in args.runs for row in by_run[run]]
    seconds = np.array([r[1] for r in rows])
    tokens = np.array([[r[2], r[3]] for r in rows], dtype=float)
    (per_target, per_base), *_ = np.linalg.lstsq(tokens, seconds - intercept, rcond=None)
    predicted = intercept + tokens @ np.array([per_target, per_base])
    print(f"{len(rows)} decode steps from {', '.join(str(r) for r in args.runs)}")
    print(f"kv_read_per_token_s {per_target:.3e}  base_read_fraction {per_base / per_target:.2f}  "
          f"rms {1e3 * np.sqrt(np.mean((predicted - seconds) ** 2)):.2f} ms")
    for policy in sorted({r[0] for r in rows}):
        mask = np.array([r[0] == policy for r in rows])
        print(f"  {policy}: {mask.sum()} steps, measured median {1e3 * np.median(seconds[mask]):.2f} ms, "
              f"model median {1e3 * np.median(predicted[mask]):.2f} ms")
    extra, weights = [], []
    for run, steps in by_run.items():
        residual = np.array([r[1] - intercept - per_target * r[2] - per_base * r[3] for r in steps])
        demoted = np.array([r[4] for r in steps], dtype=bool)
        if demoted.any() and (~demoted).any():
            extra.append(float(np.median(residual[demoted]) - np.median(residual[~demoted])))
            weights.append(int(demoted.sum()))
            print(f"  {run}: {weights[-1]} demoting steps, {1e3 * extra[-1]:.2f} ms more than the others")
    if extra:
        print(f"demote_batch_s {np.average(extra, weights=weights):.4f}")


if __name__ == "__main__":
    main()
