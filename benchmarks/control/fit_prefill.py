"""Fit the step model's prefill coefficients from the prefill steps of engine headline runs with fixed prompt lengths.

    step - host_overhead - kv_read_per_token x context
        = tokens x (compute per token of the step's precision) + prefill_attention_per_key x keys

A prefill step's precision is plain fp16 (a policy without nested weights: ``compute_per_token_unnested_s``) or
the nested weights with a fraction f of the layers fast: (1 - f) x ``compute_per_token_full_s`` + f x
``compute_per_token_fast_s``. The keys a step's prefill tokens attend to are taken as tokens x (P + 1) / 2 for
prompts of P tokens: the timeline records a step's token count, not its chunks, and over a run the chunk budget
cuts prompts at every position. The four coefficients are one least squares fit over every run given; the
attention term is told apart from the per-token ones only by runs at two prompt lengths (the session-44 runs:
4,096 and 2,048). Host overhead and the KV read come from ``--step-model`` (the decode-plane fit of
fit_kv_read.py). A sample is a step of at least ``--min-tokens`` tokens (default 1,024; decode-only steps of a
closed loop carry one token per sequence).

    python benchmarks/control/fit_prefill.py benchmarks/serving/results/dense-one-gpu-s44/full-160 \
        benchmarks/serving/results/dense-one-gpu-s44/half-scale-400 --step-model h100

``--write FILE`` puts the four fitted values into a step-model JSON (rounded to four digits, as the packaged sets
hold them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
from fit_kv_read import policy_results  # beside this script: the same per-policy result files

from elastiserve.control.step_model import load_step_model

NESTED_POLICIES = {"static-fp8", "dps", "combined"}  # engine config.NESTED_POLICIES (the rest keep plain fp16)
COEFFICIENTS = ("compute_per_token_unnested_s", "compute_per_token_full_s", "compute_per_token_fast_s",
                "prefill_attention_per_key_s")


class PrefillStep(NamedTuple):
    policy: str
    seconds: float
    tokens: int
    context_tokens: int
    fast_fraction: float
    prompt_len: int


def prefill_steps(run_dir: Path, min_tokens: int = 1024, block_size: int = 16):
    """Every step of at least ``min_tokens`` tokens in a run's per-policy JSON files of a fixed-length workload."""
    for path, result in policy_results(run_dir):
        workload = result["metadata"]["settings"]["plan"]["workload"]
        if workload.get("kind") != "fixed":
            raise SystemExit(f"{path}: the key count needs a fixed prompt length, the workload is {workload['kind']}")
        for run in result["runs"]:
            for point in run["timeline"]:
                if point.get("step_tokens", 0) < min_tokens or not point.get("step_s"):
                    continue
                used = point["total_blocks"] - point["free_blocks"]
                yield PrefillStep(run["policy"], point["step_s"], point["step_tokens"], used * block_size,
                                  len(point["fast_layers"]) / point["num_layers"], workload["input_len"])


def design_row(s: PrefillStep) -> list[float]:
    """Regressors of one step, in ``COEFFICIENTS`` order."""
    nested = s.policy in NESTED_POLICIES
    keys = s.tokens * (s.prompt_len + 1) / 2
    if not nested:
        return [s.tokens, 0.0, 0.0, keys]
    return [0.0, s.tokens * (1 - s.fast_fraction), s.tokens * s.fast_fraction, keys]


def fit(runs: list[Path], step_model: str | None, min_tokens: int = 1024) -> tuple[dict[str, float], list[str]]:
    sm = load_step_model(step_model)
    steps = [s for run in runs for s in prefill_steps(run, min_tokens)]
    if not steps:
        raise SystemExit(f"no steps of >= {min_tokens} tokens in {', '.join(map(str, runs))}")
    x = np.array([design_row(s) for s in steps])
    y = np.array([s.seconds - sm.host_overhead_s - sm.kv_read_per_token_s * s.context_tokens for s in steps])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    model = x @ coef + sm.host_overhead_s + np.array([sm.kv_read_per_token_s * s.context_tokens for s in steps])
    lines = [f"{len(steps)} steps of >= {min_tokens} tokens from {', '.join(map(str, runs))}; host and KV read "
             f"from the {sm.device} step model",
             "  " + "  ".join(f"{name} {value:.3e}" for name, value in zip(COEFFICIENTS, coef)),
             f"  rms {1e3 * float(np.sqrt(np.mean((x @ coef - y) ** 2))):.2f} ms"]
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(steps):
        precision = "fast" if s.fast_fraction == 1 else "full" if s.fast_fraction == 0 else "mixed"
        groups.setdefault((s.prompt_len, s.policy, precision), []).append(i)
    for (prompt_len, policy, precision), idx in sorted(groups.items()):
        measured = np.median([steps[i].seconds for i in idx])
        lines.append(f"  prompt {prompt_len}, {policy}, {precision}: {len(idx)} steps, median {1e3 * measured:.1f} ms "
                     f"measured, {1e3 * np.median(model[idx]):.1f} ms model")
    return dict(zip(COEFFICIENTS, map(float, coef))), lines


def write_coefficients(path: Path, coefficients: dict[str, float]) -> None:
    """Replace the prefill coefficients of the step-model JSON at ``path``, every other key as it was; the result
    must still load as a step model."""
    raw = json.loads(path.read_text())
    raw.update({name: float(f"{value:.4g}") for name, value in coefficients.items()})
    path.write_text(json.dumps(raw, indent=2) + "\n")
    load_step_model(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="headline result folders of fixed-length workloads")
    parser.add_argument("--step-model", default=None, help="packaged name or JSON for host overhead and KV read")
    parser.add_argument("--min-tokens", type=int, default=1024)
    parser.add_argument("--write", type=Path, default=None,
                        help="a step-model JSON whose four prefill coefficients to replace with the fitted ones (its "
                             "provenance is left for you to update)")
    args = parser.parse_args()
    coefficients, lines = fit(args.runs, args.step_model, args.min_tokens)
    print("\n".join(lines))
    if args.write:
        write_coefficients(args.write, coefficients)
        print(f"wrote {', '.join(COEFFICIENTS)} into {args.write}")


if __name__ == "__main__":
    main()
