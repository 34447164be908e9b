"""Fit the step model's KV-read and demotion coefficients from the decode steps of H200 engine headline runs.

    step = host_overhead + weight_read_unnested + kv_read_per_token x (TARGET tokens + base_read_fraction x BASE)

The intercept is held at the packaged model's (both from measured batch-1 steps); the two coefficients are a least
squares fit over every sample that is one decode-only step that did not demote (same running and waiting counts on
both sides, under 60 ms, so no prefill chunk), with context from the pool's used blocks: TARGET blocks x 16 + BASE
pairs x 32 tokens.
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
from dataclasses import dataclass
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


@dataclass
class KVReadFit:
    per_target_s: float  # kv_read_per_token_s
    base_read_fraction: float
    rms_s: float
    demote_batch_s: float | None  # None: no run had both demoting and other steps
    lines: list[str]  # the report, one line each


def fit(runs: list[Path]) -> KVReadFit:
    model = load_step_model()
    intercept = model.host_overhead_s + model.weight_read_unnested_s
    by_run = {run: list(decode_steps(run)) for run in runs}
    rows = [row for run in runs for row in by_run[run]]
    seconds = np.array([r[1] for r in rows])
    tokens = np.array([[r[2], r[3]] for r in rows], dtype=float)
    quiet = ~np.array([r[4] for r in rows], dtype=bool)  # demoting steps carry the demotion cost: fitted after
    (per_target, per_base), *_ = np.linalg.lstsq(tokens[quiet], seconds[quiet] - intercept, rcond=None)
    predicted = intercept + tokens @ np.array([per_target, per_base])
    rms = float(np.sqrt(np.mean((predicted - seconds)[quiet] ** 2)))  # of the fitted steps
    lines = [f"{len(rows)} decode steps from {', '.join(str(r) for r in runs)}",
             f"kv_read_per_token_s {per_target:.3e}  base_read_fraction {per_base / per_target:.2f}  "
             f"rms {1e3 * rms:.2f} ms"]
    for policy in sorted({r[0] for r in rows}):
        mask = np.array([r[0] == policy for r in rows])
        lines.append(f"  {policy}: {mask.sum()} steps, measured median {1e3 * np.median(seconds[mask]):.2f} ms, "
                     f"model median {1e3 * np.median(predicted[mask]):.2f} ms")
    extra, weights = [], []
    for run, steps in by_run.items():
        residual = np.array([r[1] - intercept - per_target * r[2] - per_base * r[3] for r in steps])
        demoted = np.array([r[4] for r in steps], dtype=bool)
        if demoted.any() and (~demoted).any():
            extra.append(float(np.median(residual[demoted]) - np.median(residual[~demoted])))
            weights.append(int(demoted.sum()))
            lines.append(f"  {run}: {weights[-1]} demoting steps, {1e3 * extra[-1]:.2f} ms more than the others")
    demote = float(np.average(extra, weights=weights)) if extra else None
    if demote is not None:
        lines.append(f"demote_batch_s {demote:.4f}")
    return KVReadFit(float(per_target), float(per_base / per_target), rms, demote, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    print("\n".join(fit(parser.parse_args().runs).lines))


if __name__ == "__main__":
    main()
