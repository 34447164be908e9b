"""Prometheus text exposition (format 0.0.4), written by hand so the server needs no extra package.

Request latencies are histograms fed by the server; engine state (KV usage, BASE exposure, precision mode,
transitions, preemptions, ...) is exported from ``engine.stats()`` at scrape time: every numeric field becomes a gauge
``elastiserve_<field>``, every string field an info-style gauge ``elastiserve_<field>{value="..."} 1``.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

PREFIX = "elastiserve_"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    name = _NAME_OK.sub("_", key)
    return name if not name[:1].isdigit() else "_" + name


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _escape(label_value: str) -> str:
    return label_value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        self.name, self.help_text = name, help_text
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last slot is +Inf
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_fmt(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {_fmt(self.total)}", f"{self.name}_count {self.n}"]
        return lines


class ServerMetrics:
    """Counters and histograms the server updates per request; ``render(stats)`` writes the whole page."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS_S)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Mean time per output token after the first.",
                              TOKEN_BUCKETS_S)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Time from arrival to first scheduling.",
                               LATENCY_BUCKETS_S)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS_S)
        self.counters: dict[str, float] = {"requests_total": 0, "requests_failed_total": 0,
                                           "requests_aborted_total": 0, "prompt_tokens_total": 0,
                                           "generation_tokens_total": 0}

    def count(self, key: str, amount: float = 1) -> None:
        with self._lock:
            self.counters[key] = self.counters.get(key, 0) + amount

    def observe_request(self, *, ttft_s: float | None, tpot_s: float | None, queue_s: float | None,
                        e2e_s: float | None, prompt_tokens: int, output_tokens: int) -> None:
        with self._lock:
            for hist, value in ((self.ttft, ttft_s), (self.tpot, tpot_s), (self.queue, queue_s), (self.e2e, e2e_s)):
                if value is not None and value >= 0:
                    hist.observe(value)
            self.counters["prompt_tokens_total"] += prompt_tokens
            self.counters["generation_tokens_total"] += output_tokens

    def render(self, stats: Mapping[str, Any], extra_gauges: Mapping[str, float] | None = None) -> str:
        lines: list[str] = []
        with self._lock:
            for key, value in self.counters.items():
                name = PREFIX + key
                lines += [f"# HELP {name} {key.replace('_', ' ')}.", f"# TYPE {name} counter",
                          f"{name} {_fmt(value)}"]
            for hist in (self.ttft, self.tpot, self.queue, self.e2e):
                lines += hist.render()
        lines += render_gauges({**stats, **(extra_gauges or {})})
        return "\n".join(lines) + "\n"


def _flatten(stats: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in stats.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, full + "_"))
        else:
            flat[full] = value
    return flat


def render_gauges(stats: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    for key, value in sorted(_flatten(stats).items()):
        name = PREFIX + metric_name(key)
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            lines += [f"# TYPE {name} gauge", f"{name} {_fmt(value)}"]
        elif isinstance(value, str):
            lines += [f"# TYPE {name} gauge", f'{name}{{value="{_escape(value)}"}} 1']
        elif isinstance(value, (frozenset, set, tuple, list)) and all(isinstance(v, int) for v in value):
            lines += [f"# TYPE {name}_count gauge", f"{name}_count {len(value)}"]  # e.g. fast_layers
    return lines
