"""Every control transition is an ``Event``; an ``EventLog`` collects them and summarises modes and transitions."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from elastiserve.platforms import ConfigError

EVENT_KINDS = (
    "demote",
    "demote_failed",  # a demotion that could not start: its pairs stayed TARGET
    "promote_start",
    "promote_done",
    "promote_failed",  # a promotion that could not start: its pairs stayed BASE
    "evict_residual",
    "restore_start",
    "restore_done",
    "mode_fast",
    "mode_full",
    "preempt",
)


@dataclass(frozen=True, slots=True)
class Event:
    time: float
    step: int
    kind: str
    amount: int = 1
    reason: str = ""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ConfigError(f"unknown event kind {self.kind!r}; expected one of {EVENT_KINDS}")
        if self.amount < 0:
            raise ConfigError(f"event amount must be >= 0, got {self.amount}")


class EventLog:
    """Append-only list of events with the summaries the benchmark tables need. ``counts`` is kept as events are
    added: an engine's ``stats()`` reads it every step (bench timelines, the metrics endpoint), and counting the
    whole log each time grew with the run (2,500 events by the end of an elastickv dense run; 82 us a count on the
    CI CPU)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._counts: Counter[str] = Counter()

    def add(self, time: float, step: int, kind: str, amount: int = 1, reason: str = "") -> None:
        self.events.append(Event(time, step, kind, amount, reason))
        self._counts[kind] += 1

    def __len__(self) -> int:
        return len(self.events)

    def counts(self) -> dict[str, int]:
        """Number of events of each kind (kinds never added are absent)."""
        return dict(self._counts)

    def amounts(self) -> dict[str, int]:
        """Sum of ``amount`` per kind (pairs demoted, layers evicted, requests preempted, ...)."""
        totals: Counter[str] = Counter()
        for e in self.events:
            totals[e.kind] += e.amount
        return dict(totals)

    def mode_transitions(self) -> tuple[int, int]:
        """(full -> fast, fast -> full) transition counts."""
        counts = self.counts()
        return counts.get("mode_fast", 0), counts.get("mode_full", 0)

    def time_in_modes(self, start: float, end: float) -> dict[str, float]:
        """Seconds spent in 'full' and 'fast' between ``start`` and ``end``, assuming the replica starts in full
        mode unless its first mode event is at ``start``. 'fast' is any time with at least one layer in FP8: a mode
        event's amount is the number of layers entering or leaving (0 = the whole model, counted as one), so a
        per-layer restore that brings back one layer of thirty does not end the fast time."""
        if end < start:
            raise ConfigError("end must not precede start")
        spent = {"full": 0.0, "fast": 0.0}
        fast_layers, since = 0, start
        for e in self.events:
            if e.kind not in ("mode_fast", "mode_full") or e.time > end:
                continue
            at = max(e.time, start)
            spent["fast" if fast_layers else "full"] += at - since
            step = max(e.amount, 1)
            fast_layers = fast_layers + step if e.kind == "mode_fast" else max(0, fast_layers - step)
            since = at
        spent["fast" if fast_layers else "full"] += end - since
        return spent

    def restore_latencies(self) -> list[float]:
        """Seconds from each restore_start to the next restore_done."""
        out, started = [], None
        for e in self.events:
            if e.kind == "restore_start" and started is None:
                started = e.time
            elif e.kind == "restore_done" and started is not None:
                out.append(e.time - started)
                started = None
        return out
