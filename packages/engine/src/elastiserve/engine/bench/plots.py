"""PNG plots (matplotlib, Agg): a request-rate sweep like DPS Figure 6 and a timeline like DPS Figure 7.

Stats keys are looked up by a short list of names so the plots follow the engine's `stats()` without a schema;
a missing series is drawn as an empty panel with a note rather than failing the whole figure.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from elastiserve.engine.bench.replay import ReplayResult

KV_KEYS = ("kv_usage", "kv_cache_usage", "kv_occupancy")
BASE_KEYS = ("base_residency", "base_fraction", "base_pairs")
FAST_KEYS = ("fast_fraction", "num_fast_layers", "fast_layers")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _nan_to_none(values: list[float]) -> list[float]:
    return [v if v is not None and math.isfinite(v) else math.nan for v in values]


def plot_rate_sweep(sweeps: dict[str, list[dict[str, Any]]], path: Path, *, title: str = "") -> Path:
    """``sweeps[policy]`` = summaries (from `summarize`) at increasing rates."""
    plt = _pyplot()
    panels = [("attainment", "SLO attainment (%)", 100.0), ("achieved_rate", "achieved rate (req/s)", 1.0),
              ("tpot_mean", "mean TPOT (ms)", 1000.0), ("ttft_mean", "mean TTFT (s)", 1.0)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (key, label, scale) in zip(axes, panels):
        for policy, summaries in sweeps.items():
            points = sorted((s["rate"], s.get(key)) for s in summaries if s.get("rate") is not None)
            xs = [p[0] for p in points]
            ys = _nan_to_none([None if p[1] is None else p[1] * scale for p in points])
            ax.plot(xs, ys, marker="o", label=policy)
        if key == "ttft_mean":
            ax.axhline(2.0, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path, title)


def _series(samples: list[dict[str, Any]], keys: tuple[str, ...]) -> tuple[str | None, list[float], list[float]]:
    for key in keys:
        points = [(s["t"], s[key]) for s in samples if isinstance(s.get(key), (int, float, list, tuple, frozenset))]
        if points:
            return key, [p[0] for p in points], [float(p[1]) if isinstance(p[1], (int, float)) else float(len(p[1]))
                                                 for p in points]
    return None, [], []


def _kv_series(samples: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    key, xs, ys = _series(samples, KV_KEYS)
    if key is not None:
        return xs, ys
    points = [(s["t"], 1.0 - s["free_blocks"] / s["total_blocks"]) for s in samples
              if s.get("total_blocks") and "free_blocks" in s]
    return [p[0] for p in points], [p[1] for p in points]


def _mode_series(result: ReplayResult) -> tuple[list[float], list[float]]:
    """1 while in fast mode, from the mode events (steps), or from a fast-fraction stat."""
    mode_events = [e for e in result.events if e["kind"] in ("mode_fast", "mode_full")]
    if mode_events:
        xs, ys, level = [0.0], [0.0], 0.0
        for e in mode_events:
            xs += [e["time"], e["time"]]
            ys += [level, 1.0 if e["kind"] == "mode_fast" else 0.0]
            level = ys[-1]
        return [*xs, result.duration], [*ys, level]
    key, xs, ys = _series(result.samples, FAST_KEYS)
    if key is None:  # only a mode name: 1 while "fast"
        points = [(s["t"], 1.0 if s["mode"] == "fast" else 0.0) for s in result.samples if "mode" in s]
        xs, ys = [p[0] for p in points], [p[1] for p in points]
    return xs, ys


def plot_timeline(results: dict[str, ReplayResult], path: Path, *, title: str = "") -> Path:
    """KV occupancy, precision mode, BASE residency and TTFT (at each request's arrival) over time, per policy."""
    plt = _pyplot()
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    for policy, result in results.items():
        axes[0].step(*_kv_series(result.samples), where="post", label=policy, linewidth=1)
        axes[1].step(*_mode_series(result), where="post", label=policy, linewidth=1)
        key, xs, ys = _series(result.samples, BASE_KEYS)
        axes[2].plot(xs, ys, label=policy, linewidth=1)
        if key:
            axes[2].set_ylabel(f"BASE ({key})")
        done = [r for r in result.records if r.token_times]
        axes[3].scatter([r.arrival for r in done], [r.ttft for r in done], s=8, label=policy)
    axes[0].set_ylabel("KV occupancy")
    axes[1].set_ylabel("fast mode (layers)")
    if not axes[2].get_ylabel():
        axes[2].set_ylabel("BASE pairs")
    axes[3].set_ylabel("TTFT (s)")
    axes[3].axhline(2.0, color="gray", linestyle="--", linewidth=0.8)
    axes[3].set_xlabel("time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper right")
    return _save(plt, fig, path, title)


def _save(plt: Any, fig: Any, path: Path, title: str | None) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
