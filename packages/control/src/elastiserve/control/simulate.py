"""Command line: run presets (and optionally the ElasticKV ablations) over a trace window and print one table.

    python -m elastiserve.control.simulate --trace azure --window 0:1200 --time-scale 0.2 --presets all

The ElasticKV ablation setting (paper App. C.6, lengths scaled 4x down), a closed-loop client at concurrency 38:

    python -m elastiserve.control.simulate --fixed 1024:256:600 --max-concurrency 38 --native-blocks 2560 \
        --max-num-batched-tokens 2048 --presets elastickv --ablations

``--f-post free`` runs every configuration with the paper's F_post (free blocks after scheduling) instead of ours
(free blocks less the capacity admitted and queued prompts are committed to); see the package README.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from elastiserve.control.config import F_POST_RULES, PRESETS, ControlConfig, preset
from elastiserve.control.metrics import format_table
from elastiserve.control.sim_replica import ReplicaConfig
from elastiserve.control.simulator import SimConfig, simulate
from elastiserve.control.step_model import PACKAGED_STEP_MODELS, load_step_model
from elastiserve.control.workloads import Request, load_trace
from elastiserve.platforms import ConfigError

ABLATIONS = {
    "watermark-demotion": {"demotion_trigger": "watermark", "watermark": 256},
    "eager-promotion": {"promotion": "eager"},
    "no-promotion": {"promotion": "none"},
}


def ablation(name: str) -> ControlConfig:
    """ElasticKV with one mechanism changed (paper App. C.7)."""
    base = preset("elastickv").with_kv(**ABLATIONS[name])
    return ControlConfig(name=name, kv=base.kv, precision=base.precision, arbiter=base.arbiter)


def with_f_post(config: ControlConfig, rule: str) -> ControlConfig:
    """The same configuration (and name) with F_post computed by ``rule`` (``KVFidelityConfig.f_post``)."""
    return replace(config, kv=replace(config.kv, f_post=rule))


def parse_window(text: str) -> tuple[int, int | None]:
    start, _, count = text.partition(":")
    try:
        return int(start or 0), (int(count) if count else None)
    except ValueError as exc:
        raise ConfigError(f"--window wants START:COUNT, got {text!r}") from exc


def parse_fixed(text: str) -> list[Request]:
    """PROMPT:OUTPUT:COUNT -> COUNT identical requests, all ready at t=0 (pace them with --max-concurrency)."""
    try:
        prompt, output, count = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise ConfigError(f"--fixed wants PROMPT:OUTPUT:COUNT, got {text!r}") from exc
    return [Request(i, 0.0, prompt, output) for i in range(count)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m elastiserve.control.simulate", description=__doc__)
    p.add_argument("--trace", default="azure", help="azure, azure-window, mooncake, sharegpt, arxiv, sharegpt-v3")
    p.add_argument("--window", default="0:1200", help="START:COUNT rows of the trace")
    p.add_argument("--time-scale", type=float, default=0.2, help="multiply arrival offsets (0.2 = 5x faster)")
    p.add_argument("--fixed", default=None, help="PROMPT:OUTPUT:COUNT fixed-length requests instead of a trace")
    p.add_argument("--max-concurrency", type=int, default=None, help="closed-loop client: most requests outstanding")
    p.add_argument("--rate", type=float, default=None, help="replace arrivals with Gamma(cv) arrivals at this rate")
    p.add_argument("--cv", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--presets", default="all", help=f"comma list of {PRESETS} or 'all'")
    p.add_argument("--ablations", action="store_true", help="also run the ElasticKV ablation variants")
    p.add_argument(
        "--f-post",
        default="committed",
        choices=F_POST_RULES,
        help="promotion budget: free blocks less committed prompts (ours) or free blocks (the paper's)",
    )
    p.add_argument("--engine-admission", action="store_true",
                   help="the engine's admission for demoting presets: admissions counted in D_t, base-floor bound")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--router", default="least-loaded", choices=("least-loaded", "round-robin"))
    p.add_argument("--native-blocks", type=int, default=4096, help="FP16 KV budget per replica, in blocks")
    p.add_argument("--units-per-layer", type=int, default=None,
                   help="residual units per decoder layer (default: the step model's residual_units_per_layer, "
                        "104 for Llama-3.1-8B in 2 MiB units)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-step-time", type=float, default=None,
                   help="seconds: cap prefill chunks per precision mode to keep steps under it (step_budget.py)")
    p.add_argument("--queue-fast-after", type=float, default=None,
                   help="seconds: also run each preset that evicts with PrecisionConfig.queue_fast_s (name+queue)")
    p.add_argument("--queue-fast-hold", type=float, default=None,
                   help="seconds: PrecisionConfig.queue_fast_hold_s of the +queue presets (default 2)")
    p.add_argument("--prefill-fast", action="store_true",
                   help="also run each preset that evicts with PrecisionConfig.prefill_fast (steps with a prefill "
                        "chunk run every layer fast), together with --queue-fast-after when given (name+queue+prefill)")
    p.add_argument("--step-model", default=None,
                   help=f"step-time coefficients: one of {sorted(PACKAGED_STEP_MODELS)} or a JSON file (default: h200)")
    p.add_argument("--trace-dir", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> str:
    args = build_parser().parse_args(argv)
    start, count = parse_window(args.window)
    if args.fixed:
        requests = parse_fixed(args.fixed)
    else:
        requests = load_trace(args.trace, start, count, rate=args.rate, cv=args.cv, seed=args.seed,
                              time_scale=args.time_scale, trace_dir=args.trace_dir)
    names = list(PRESETS) if args.presets == "all" else [n.strip() for n in args.presets.split(",")]
    configs = [preset(n) for n in names] + ([ablation(a) for a in ABLATIONS] if args.ablations else [])
    configs = [with_f_post(c, args.f_post) for c in configs]
    if args.engine_admission:
        configs = [c.with_engine_admission() for c in configs]
    if args.queue_fast_hold is not None and args.queue_fast_after is None:
        raise ConfigError("--queue-fast-hold needs --queue-fast-after")
    compute_rules: dict[str, object] = {}
    suffix = ""
    if args.queue_fast_after is not None:
        compute_rules = {"queue_fast_s": args.queue_fast_after}
        compute_rules |= {} if args.queue_fast_hold is None else {"queue_fast_hold_s": args.queue_fast_hold}
        suffix = "+queue"
    if args.prefill_fast:
        compute_rules["prefill_fast"] = True
        suffix += "+prefill"
    if compute_rules:
        configs += [replace(c.with_precision(**compute_rules), name=f"{c.name}{suffix}")
                    for c in configs if "evict" in c.arbiter.mechanisms]
    step_model = load_step_model(args.step_model)
    # The eviction granule must be the step model's model's. At 32 units a layer (the default before session 44) each
    # evicted layer freed a third of Llama-3.1-8B's 104 blocks, so combined evicted nearly every layer: 97 % FP8
    # layer-time where the engine, at 104, evicted half (48 %, dense half-scale run on an H100, session 44).
    units_per_layer = step_model.residual_units_per_layer if args.units_per_layer is None else args.units_per_layer
    sim = SimConfig(
        replica=ReplicaConfig(native_blocks=args.native_blocks, units_per_layer=units_per_layer,
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              max_step_time_s=args.max_step_time),
        replicas=args.replicas, router=args.router, max_concurrency=args.max_concurrency,
    )
    rows = []
    for config in configs:
        began = time.perf_counter()
        summary = simulate(requests, config, sim, step_model).summary()
        row = summary.row()
        row["sim s"] = f"{time.perf_counter() - began:.1f}"
        rows.append(row)
    table = format_table(rows)
    end = "" if count is None else start + count
    source = f"fixed {args.fixed}" if args.fixed else f"{args.trace} rows {start}:{end}"
    header = (f"{source} ({len(requests)} requests), "
              f"{args.replicas} replica(s), step model: {step_model.device} [{step_model.provenance[:40]}...]")
    print(header)
    print(table)
    return table


if __name__ == "__main__":
    main()
