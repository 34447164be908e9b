"""Serving metrics shared by the simulator and the engine's benchmark harness (plain Python, no numpy).

Definitions (all times in seconds):

* TTFT = first token time - arrival.  TPOT = (last token - first token) / (tokens - 1).
* TBT gaps = consecutive inter-token intervals; ``max_tbt`` their maximum; ``tail_tbt`` the mean of the slowest
  k = max(1, ceil(0.1 (n - 1))) gaps (Mooncake's TBT, as ElasticKV App. C.3 restates it).
* Joint SLO (DPS paper V-A): max TBT <= 5 x T_base and TTFT <= 2 s. Attainment = fraction of requests meeting it.
* Capacity: the highest swept rate such that every swept rate up to it has attainment >= 90 %.
* Eff@tau (Mooncake / ElasticKV C.3): fraction of requests with TTFT < 30 s and tail TBT < tau (tau = 0.3 s).
* BASE exposure (ElasticKV C.1): fraction of attention-visible KV pairs executed in BASE, summed over every step;
  ``ExposureMeter`` also reports the step-time-weighted variant.
* Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from elastiserve.platforms import ConfigError


@dataclass(slots=True)
class RequestRecord:
    """One request's life. ``token_times`` holds the completion time of every output token, first token first."""

    req_id: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    preemptions: int = 0
    base_pair_reads: int = 0
    pair_reads: int = 0

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def ttft(self) -> float:
        if not self.token_times:
            return math.inf
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float:
        n = len(self.token_times)
        return 0.0 if n < 2 else (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def max_tbt(self) -> float:
        gaps = self.gaps
        return max(gaps) if gaps else 0.0

    @property
    def tail_tbt(self) -> float:
        gaps = sorted(self.gaps, reverse=True)
        if not gaps:
            return 0.0
        k = max(1, math.ceil(0.1 * len(gaps)))
        return sum(gaps[:k]) / k

    @property
    def base_exposure(self) -> float:
        return self.base_pair_reads / self.pair_reads if self.pair_reads else 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for an empty list."""
    if not 0 <= q <= 100:
        raise ConfigError(f"percentile q must lie in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def meets_joint_slo(r: RequestRecord, t_base: float, tbt_factor: float = 5.0, ttft_limit: float = 2.0) -> bool:
    """DPS joint SLO: finished, TTFT <= ttft_limit and max TBT <= tbt_factor x t_base."""
    return r.finished and r.ttft <= ttft_limit and r.max_tbt <= tbt_factor * t_base


def slo_attainment(
    records: list[RequestRecord], t_base: float, tbt_factor: float = 5.0, ttft_limit: float = 2.0
) -> float:
    if not records:
        return math.nan
    return sum(meets_joint_slo(r, t_base, tbt_factor, ttft_limit) for r in records) / len(records)


def eff_at(records: list[RequestRecord], tau: float = 0.3, ttft_limit: float = 30.0) -> float:
    """Mooncake's effective-request ratio Eff@tau: TTFT < ttft_limit and tail TBT < tau (strict, as published)."""
    if not records:
        return math.nan
    good = sum(r.finished and r.ttft < ttft_limit and r.tail_tbt < tau for r in records)
    return good / len(records)


def capacity_from_sweep(attainment_by_rate: dict[float, float], threshold: float = 0.9) -> float:
    """Highest rate r such that attainment >= threshold at r and at every lower swept rate; 0.0 if none."""
    capacity = 0.0
    for rate in sorted(attainment_by_rate):
        if attainment_by_rate[rate] < threshold:
            break
        capacity = rate
    return capacity


class ExposureMeter:
    """Accumulates BASE exposure over steps: per step, the pairs attention reads and how many of them are BASE."""

    def __init__(self) -> None:
        self.base_pairs = 0
        self.pairs = 0
        self.weighted_base = 0.0
        self.weighted_time = 0.0

    def add(self, duration: float, base_pairs_read: int, pairs_read: int) -> None:
        if base_pairs_read < 0 or base_pairs_read > pairs_read or duration < 0:
            raise ConfigError(f"bad exposure sample: {base_pairs_read}/{pairs_read} over {duration}s")
        self.base_pairs += base_pairs_read
        self.pairs += pairs_read
        if pairs_read:
            self.weighted_base += duration * base_pairs_read / pairs_read
            self.weighted_time += duration

    @property
    def exposure(self) -> float:
        """Paper definition: sum of BASE pairs read / sum of pairs read, over all steps."""
        return self.base_pairs / self.pairs if self.pairs else 0.0

    @property
    def time_weighted(self) -> float:
        return self.weighted_base / self.weighted_time if self.weighted_time else 0.0


class ModeMeter:
    """Time in fast mode: any layer fast ('fast time') and layer-weighted ('FP8 layer-time fraction')."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = max(1, num_layers)
        self.total = 0.0
        self.any_fast = 0.0
        self.layer_fast = 0.0

    def add(self, duration: float, fast_layer_count: int) -> None:
        self.total += duration
        if fast_layer_count:
            self.any_fast += duration
            self.layer_fast += duration * fast_layer_count / self.num_layers

    @property
    def fast_fraction(self) -> float:
        return self.any_fast / self.total if self.total else 0.0

    @property
    def fp8_layer_fraction(self) -> float:
        return self.layer_fast / self.total if self.total else 0.0


@dataclass(frozen=True, slots=True)
class RunSummary:
    name: str
    requests: int
    finished: int
    attainment: float
    eff300: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    tpot_mean: float
    tail_tbt_p90: float
    preemptions: int
    base_exposure: float
    fast_fraction: float
    fp8_layer_fraction: float
    transitions: int
    demoted_pairs: int
    promoted_pairs: int
    restore_latency_mean: float
    makespan: float

    def row(self) -> dict[str, str]:
        pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
        return {
            "preset": self.name,
            "attain": pct(self.attainment),
            "eff@300": pct(self.eff300),
            "TTFT p50": f"{self.ttft_p50:.2f}s",
            "TTFT p90": f"{self.ttft_p90:.2f}s",
            "TTFT mean": f"{self.ttft_mean:.2f}s",
            "TPOT": f"{1000 * self.tpot_mean:.1f}ms",
            "preempt": str(self.preemptions),
            "BASE exp": pct(self.base_exposure),
            "fast time": pct(self.fast_fraction),
            "fp8 layer-time": pct(self.fp8_layer_fraction),
            "transitions": str(self.transitions),
            "demote/promote": f"{self.demoted_pairs}/{self.promoted_pairs}",
        }


def format_table(rows: list[dict[str, str]]) -> str:
    """Plain fixed-width table of string cells, one header line."""
    if not rows:
        return ""
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in keys}
    lines = ["  ".join(k.rjust(widths[k]) for k in keys)]
    lines += ["  ".join(r[k].rjust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)
