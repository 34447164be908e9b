"""Fit the step model's decode coefficients from the decode steps of H200 engine headline runs, in two stages.

    step = intercept + kv_read_per_token x (TARGET tokens + base_read_fraction x BASE tokens) x padding
           + base_step (a step whose batch reads any BASE pair) + demotion (a step that demoted),
    padding = 1 + padded_row_kv_fraction x (graph batch - sequences) / sequences

1. The TARGET plane (intercept, kv_read_per_token and padded_row_kv_fraction) is a least squares fit over the
   reference policy's steps (static-fp16: no BASE pair, no demotion), from ``--target-runs`` if given, else from the
   runs themselves. The graph batch is the CUDA-graph size the step padded to (``step_model.padded_batch`` with the
   run's ``max_num_seqs``): at a full pool the static-fp16 steps ran at 32 or 48 rows, at the same context.
2. Over the other policies' steps, with the plane held, the residual of the quiet steps (no demotion, no promotion
   starting or finishing) that read BASE pairs is fitted as base_read_fraction x kv_read_per_token x BASE tokens +
   base_step. Pooling both policies with one intercept (the session-6 script) charged elastickv's per-step cost to
   the BASE coefficient: with the pool full TARGET + BASE / 2 is nearly constant, so BASE and the intercept are
   nearly collinear (1.40x then; 1.04x / 0.85x plus a 2.8 / 4.0 ms step constant at concurrency 38 / 64).
3. The demotion cost per batch is the median residual of the steps that demoted less that of the quiet steps that
   read BASE pairs, after the model's bytes-based pack cost of the pairs demoted, per run, weighted by demoting steps.
4. With ``--decode-run`` (a bench_decode.py JSON with static-fp16, nested full and fast steps side by side, from the
   same device): host overhead (the batch-1 step less its forward pass) and the nested weight reads, as the batch-1
   step less host overhead and its KV read, and anchored to the fitted plain fp16 intercept less that host
   overhead by the nested step's difference to the same run's static-fp16 step.

A sample is one decode-only step when exactly one step separates it from the previous one, the running and waiting
counts did not change and it took under 60 ms (no prefill chunk). Context comes from the pool's used blocks: a
BASE pair holds one packed block and a PROMOTING pair that block plus two reserved fresh ones, and readers treat
both as BASE (32 tokens each; kv_manager's ``base_pairs`` count leaves the promoting ones out); the remaining used
blocks are TARGET, 16 tokens each.

    python benchmarks/control/fit_kv_read.py benchmarks/serving/results/dense-full-run3 \
        --target-runs benchmarks/serving/results/dense-full-run2 benchmarks/serving/results/dense-paper-run1 \
        --decode-run benchmarks/engine/results/h200-llama8b-decode-run5.json
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from elastiserve.control.step_model import load_step_model, padded_batch

DECODE_STEP_MAX_S = 0.06
REFERENCE_POLICY = "static-fp16"
ENGINE_MAX_NUM_SEQS = 256  # EngineConfig's default, for runs whose metadata does not say


class Step(NamedTuple):
    policy: str
    seconds: float
    target_tokens: int
    base_tokens: int
    demoted_pairs: int
    promotion_event: bool  # a promotion started or finished: its copy or unpack lands in this step
    running: int
    graph_batch: int  # the CUDA-graph batch the step padded to


def policy_results(run_dir: Path):
    """(path, result) of each per-policy JSON file of a dense headline run (``dense-*.json.gz`` or ``.json``)."""
    for path in sorted([*run_dir.glob("dense-*.json.gz"), *run_dir.glob("dense-*.json")]):
        with (gzip.open(path) if path.suffix == ".gz" else path.open()) as f:
            yield path, json.load(f)


def decode_steps(run_dir: Path, block_size: int = 16):
    """Every decode-only step in the run's per-policy JSON files."""
    for _, result in policy_results(run_dir):
        engine = result.get("metadata", {}).get("settings", {}).get("engine", {})
        max_num_seqs = engine.get("max_num_seqs", ENGINE_MAX_NUM_SEQS)
        for run in result["runs"]:
            for before, after in itertools.pairwise(run["timeline"]):
                seconds = after["t"] - before["t"]
                same_batch = after["running"] == before["running"] and after["waiting"] == before["waiting"]
                if after["steps"] - before["steps"] != 1 or not same_batch or seconds >= DECODE_STEP_MAX_S:
                    continue
                used = after["total_blocks"] - after["free_blocks"]
                base, promoting = after["base_pairs"], after["promoting_pairs"]
                target_blocks = used - base - 3 * promoting
                promotion_event = (after["promotions"] != before["promotions"]
                                   or promoting != before["promoting_pairs"])
                yield Step(run["policy"], seconds, target_blocks * block_size, (base + promoting) * 2 * block_size,
                           after["demotions"] - before["demotions"], promotion_event, after["running"],
                           padded_batch(after["running"], max_num_seqs))


@dataclass
class KVReadFit:
    intercept_s: float  # host_overhead_s + weight_read_unnested_s at decode batch sizes
    padded_row_kv_fraction: float
    per_target_s: float  # kv_read_per_token_s
    base_read_fraction: float
    base_step_s: float
    target_rms_s: float  # of the reference steps about the TARGET plane
    base_rms_s: float  # of the quiet steps that read BASE pairs about the full model
    demote_batch_s: float | None  # None: no run had both demoting and quiet BASE steps
    lines: list[str]  # the report, one line each


def padding_rows(s: Step) -> float:
    """Padding rows of the step's graph per running sequence."""
    return (s.graph_batch - s.running) / s.running


def fit(runs: list[Path], target_runs: list[Path] | None = None, reference: str = REFERENCE_POLICY) -> KVReadFit:
    demote_per_pair = load_step_model().demote_per_pair_s  # bytes-based pack kernel, not fitted here
    target_runs = runs if target_runs is None else target_runs
    ref_by_run = {run: [s for s in decode_steps(run) if s.policy == reference] for run in target_runs}
    ref = [s for run in target_runs for s in ref_by_run[run]]
    if not ref:
        raise SystemExit(f"no {reference} decode steps in {', '.join(map(str, target_runs))}")
    ref_s = np.array([s.seconds for s in ref])
    ref_x = np.array([[1.0, s.target_tokens, s.target_tokens * padding_rows(s)] for s in ref])
    coef, *_ = np.linalg.lstsq(ref_x, ref_s, rcond=None)
    intercept, per_target, padded_fraction = coef[0], coef[1], coef[2] / coef[1]
    target_rms = float(np.sqrt(np.mean((ref_x @ coef - ref_s) ** 2)))

    def padding(s: Step) -> float:
        return 1 + padded_fraction * padding_rows(s)

    by_run = {run: [s for s in decode_steps(run) if s.policy != reference] for run in runs}
    steps = [s for run in runs for s in by_run[run]]
    residual = np.array([s.seconds - intercept - per_target * s.target_tokens * padding(s) for s in steps])
    base = np.array([s.base_tokens * padding(s) for s in steps])
    quiet_base = np.array([not s.demoted_pairs and not s.promotion_event for s in steps]) & (base > 0)
    if not quiet_base.any():
        raise SystemExit(f"no quiet decode steps with BASE pairs in {', '.join(map(str, runs))}")
    x = np.stack([base, np.ones_like(base)], axis=1)[quiet_base]
    (per_base, base_step), *_ = np.linalg.lstsq(x, residual[quiet_base], rcond=None)
    base_rms = float(np.sqrt(np.mean((x @ [per_base, base_step] - residual[quiet_base]) ** 2)))

    lines = [f"TARGET plane: {len(ref)} {reference} decode steps from {', '.join(map(str, target_runs))}",
             f"  intercept {1e3 * intercept:.3f} ms  kv_read_per_token_s {per_target:.3e}  "
             f"padded_row_kv_fraction {padded_fraction:.3f}  rms {1e3 * target_rms:.2f} ms",
             f"BASE terms: {len(steps)} decode steps from {', '.join(map(str, runs))}, {int(quiet_base.sum())} quiet "
             "ones read BASE pairs",
             f"  base_read_fraction {per_base / per_target:.2f}  base_step_s {base_step:.4f}  "
             f"rms {1e3 * base_rms:.2f} ms"]

    def model(s: Step) -> float:
        kv = (per_target * s.target_tokens + per_base * s.base_tokens) * padding(s)
        return intercept + kv + (base_step if s.base_tokens else 0.0) + demote_per_pair * s.demoted_pairs

    for run, group in [*ref_by_run.items(), *by_run.items()]:
        for policy, size in sorted({(s.policy, s.graph_batch) for s in group}):
            chosen = [s for s in group if (s.policy, s.graph_batch) == (policy, size) and not s.demoted_pairs]
            if len(chosen) >= 50:
                lines.append(f"  {run} {policy}, graph batch {size}: {len(chosen)} steps without demotion, measured "
                             f"median {1e3 * np.median([s.seconds for s in chosen]):.2f} ms, "
                             f"model {1e3 * np.median([model(s) for s in chosen]):.2f} ms")

    extra, weights = [], []
    for run, group in by_run.items():
        res = np.array([s.seconds - model(s) for s in group])
        demoted = np.array([s.demoted_pairs > 0 and not s.promotion_event for s in group])
        quiet = np.array([not s.demoted_pairs and not s.promotion_event and s.base_tokens > 0 for s in group])
        if demoted.any() and quiet.any():
            extra.append(float(np.median(res[demoted]) - np.median(res[quiet])))
            weights.append(int(demoted.sum()))
            lines.append(f"  {run}: {weights[-1]} demoting steps, {1e3 * extra[-1]:.2f} ms more than the quiet ones "
                         "with BASE pairs")
    demote = float(np.average(extra, weights=weights)) if extra else None
    if demote is not None:
        lines.append(f"demote_batch_s {demote:.4f}")
    return KVReadFit(float(intercept), float(padded_fraction), float(per_target), float(per_base / per_target),
                     float(base_step), target_rms, base_rms, demote, lines)


def nested_weight_reads(decode_run: Path, result: KVReadFit) -> dict[str, float]:
    """Weight reads from one bench_decode.py run's batch-1 steps (static-fp16 ``roofline``, nested ``fast_full``),
    keyed ``direct_*`` (step less host and KV read; a batch-1 graph has no padding) and ``*_s`` (the JSON's: the
    fitted plain fp16 weight read plus the nested step's difference to the static-fp16 step of the same run)."""
    raw = json.loads(decode_run.read_text())
    roofline = raw["roofline"]
    nested = next(row for row in raw["fast_full"] if row["batch"] == 1)
    host = roofline["step_s"] - roofline["forward_only_s"]
    one_row = host + result.per_target_s * (roofline["context"] + 1)
    # The serving intercept is host overhead plus the plain fp16 weight read; the host part is this run's own
    # (H200 run5 0.258 ms, H100 s43 0.345 ms: one device's figure does not carry to the other).
    plain = result.intercept_s - host
    steps = {"unnested": roofline["step_s"], "full": nested["full_s"], "fast": nested["fast_s"]}
    out = {f"direct_{mode}_s": step - one_row for mode, step in steps.items()}
    out |= {f"weight_read_{mode}_s": plain + step - steps["unnested"] for mode, step in steps.items()}
    out["host_s"] = host
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="runs whose BASE-holding policies fit the BASE terms")
    parser.add_argument("--target-runs", nargs="+", type=Path, help="runs whose reference steps fit the TARGET "
                        "line (default: the runs)")
    parser.add_argument("--reference", default=REFERENCE_POLICY, help="the policy that holds no BASE pairs")
    parser.add_argument("--decode-run", type=Path, help="bench_decode.py JSON for the nested weight reads")
    args = parser.parse_args()
    result = fit(args.runs, args.target_runs, args.reference)
    print("\n".join(result.lines))
    if args.decode_run:
        reads = nested_weight_reads(args.decode_run, result)
        print(f"nested weight reads from {args.decode_run} (batch 1, host {1e3 * reads['host_s']:.3f} ms):")
        for mode in ("unnested", "full", "fast"):
            print(f"  {mode}: step less host and KV {1e3 * reads[f'direct_{mode}_s']:.3f} ms; "
                  f"weight_read_{mode}_s {reads[f'weight_read_{mode}_s']:.6f}")


if __name__ == "__main__":
    main()
