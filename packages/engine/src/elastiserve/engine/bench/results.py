"""Per-request and summary metrics of one replay (definitions in `elastiserve.control.metrics`), run metadata
(commit, device, model, every setting) and JSON output with NaN/inf written as null."""

from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
from pathlib import Path
from typing import Any

from elastiserve.control import metrics as m
from elastiserve.control.events import EventLog
from elastiserve.engine.bench.replay import ReplayResult

SLO_TBT_FACTOR = 5.0
SLO_TTFT_S = 2.0


def per_request(records: list[m.RequestRecord], t_base: float) -> list[dict[str, Any]]:
    return [{"id": r.req_id, "arrival": r.arrival, "prompt_tokens": r.prompt_tokens,
             "output_tokens": len(r.token_times), "finished": r.finished, "ttft": r.ttft, "tpot": r.tpot,
             "max_tbt": r.max_tbt, "tail_tbt": r.tail_tbt, "meets_slo": m.meets_joint_slo(r, t_base),
             "preemptions": r.preemptions, "base_exposure": r.base_exposure} for r in records]


def event_log_of(events: list[dict[str, Any]], start_mode: str = "full", start_fast_layers: int = 0) -> EventLog:
    """Events as an `EventLog`; a replay that starts in fast mode (e.g. static-fp8 switched during the T_base run)
    gets a mode_fast event at time 0 for the layers already in FP8, so time-in-mode counts from the start."""
    log = EventLog()
    if start_mode == "fast":
        log.add(0.0, 0, "mode_fast", start_fast_layers, "mode at the start of the replay")
    for e in events:
        log.add(e["time"], e["step"], e["kind"], e["amount"], e["reason"])
    return log


def summarize(result: ReplayResult, t_base: float, *, name: str = "", rate: float | None = None) -> dict[str, Any]:
    """Summary of one run: SLO attainment (T_base measured in the same run), Eff@300, latencies, preemptions,
    BASE exposure, time per mode, transitions and restore latency."""
    records = result.records
    finished = [r for r in records if r.finished]
    ttfts = [r.ttft for r in finished]
    log = event_log_of(result.events, result.stats_before.get("mode", "full"),
                       len(result.stats_before.get("fast_layers", ())))
    to_fast, to_full = event_log_of(result.events).mode_transitions()
    modes = log.time_in_modes(0.0, max(result.duration, 0.0))
    amounts = log.amounts()
    restores = log.restore_latencies()
    base_reads = sum(r.base_pair_reads for r in records)
    reads = sum(r.pair_reads for r in records)
    tail_tbts = sorted((r.tail_tbt for r in finished), reverse=True)
    return {
        "name": name,
        "rate": rate,
        "t_base": t_base,
        "requests": len(records),
        "finished": len(finished),
        "duration_s": result.duration,
        "achieved_rate": len(finished) / result.duration if result.duration > 0 else math.nan,
        "output_tokens_per_s": sum(len(r.token_times) for r in finished) / result.duration
        if result.duration > 0 else math.nan,
        "attainment": m.slo_attainment(records, t_base, SLO_TBT_FACTOR, SLO_TTFT_S),
        "eff300": m.eff_at(records, 0.3),
        "ttft_mean": m.mean(ttfts),
        "ttft_p50": m.percentile(ttfts, 50),
        "ttft_p90": m.percentile(ttfts, 90),
        "ttft_p99": m.percentile(ttfts, 99),
        "tpot_mean": m.mean([r.tpot for r in finished if len(r.token_times) > 1]),
        "tbt_max": max((r.max_tbt for r in finished), default=math.nan),
        "tbt_top10_mean": m.mean([r.tail_tbt for r in finished]),
        "tail_tbt_p90": m.percentile(tail_tbts, 90),
        "preemptions": sum(r.preemptions for r in records),
        "base_exposure": base_reads / reads if reads else 0.0,
        "time_full_s": modes["full"],
        "time_fast_s": modes["fast"],
        "fast_fraction": modes["fast"] / result.duration if result.duration > 0 else 0.0,
        "fp8_layer_time_s": fp8_layer_time(result.samples, result.duration),
        "transitions_to_fast": to_fast,
        "transitions_to_full": to_full,
        "demoted_pairs": amounts.get("demote", 0),
        "promoted_pairs": amounts.get("promote_done", 0),
        "evicted_residuals": amounts.get("evict_residual", 0),
        "restore_latency_mean": m.mean(restores),
        "event_counts": log.counts(),
    }


def fp8_layer_time(samples: list[dict[str, Any]], duration: float) -> float:
    """Seconds of FP8 weighted by the fraction of layers in FP8 (time_fast_s counts any layer in FP8 as the whole
    model: combined's 16 of 32 layers count half here), from the per-step samples; each sample's layer set holds
    until the next sample. 0 when the samples do not say how many layers the model has."""
    total = 0.0
    for i, sample in enumerate(samples):
        if not sample.get("num_layers"):
            return 0.0
        until = samples[i + 1]["t"] if i + 1 < len(samples) else max(duration, sample["t"])
        total += (until - sample["t"]) * len(sample.get("fast_layers", ())) / sample["num_layers"]
    return total


def capacity(summaries: list[dict[str, Any]]) -> float:
    """Highest swept rate whose attainment, and that of every lower rate, is >= 90 %."""
    return m.capacity_from_sweep({s["rate"]: s["attainment"] for s in summaries if s["rate"] is not None})


def git_commit(cwd: Path | None = None) -> str:
    """ELASTISERVE_SOURCE_COMMIT when set (GPU copies of the tree), else the checkout's HEAD."""
    from elastiserve.platforms.env import settings

    if settings().source_commit:
        return settings().source_commit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).parent, capture_output=True,
                             text=True, timeout=10, check=True)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name() -> str:
    from elastiserve.platforms import current_platform

    p = current_platform()
    return f"{p.vendor.value}:{p.device_name}"


def run_metadata(*, model: str, settings: dict[str, Any]) -> dict[str, Any]:
    return {"commit": git_commit(), "device": device_name(), "model": model, "settings": settings,
            "host": platform.node(), "python": platform.python_version(),
            "started": datetime.datetime.now(datetime.UTC).isoformat()}


def clean_json(obj: Any) -> Any:
    """``obj`` made JSON-safe: non-finite floats become null, sets sorted lists, paths strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(clean_json(v) for v in obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean_json(obj), indent=2, allow_nan=False) + "\n")
    return path
