"""The garbage collector's passes, timed, so that a pause between two steps can be told apart from the steps.

On the H200 (session 14, MoE headline, dps at 24 and 27 req/s, 3,072-token chunks) the engine's host time between
two steps was 2.1 ms at the median and 5.0 ms at P99 of ~790 steps, but one gap per run, about 6 s in, took 17-18 ms
with ~130 requests running (four runs of two calls; one run had a second, 10.8 ms at 11 s). Added to a 112 ms step
it made a 129 ms gap, over the 123 ms TBT bound of the 131 requests running through it (52.0 % attainment). A
collection of what was allocated since start-up's ``gc.freeze`` is the likely cause, not a proven one: the watch
records every pass (generation, seconds), and the engine puts the collector's seconds into each step's record
(``gc_s``), next to ``step_s``, for the bench timelines.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class GcWatch:
    """Counts and times the collector's passes through ``gc.callbacks`` while installed."""

    collections: list[int] = field(default_factory=lambda: [0, 0, 0])  # per generation
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    max_seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _started: float | None = None
    _installed: bool = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_pass)
            self._installed = True

    def remove(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_pass)
            self._installed = False

    @property
    def total_s(self) -> float:
        return sum(self.seconds)

    def stats(self) -> dict[str, float | int]:
        return {"gc_collections": sum(self.collections), "gc_full_collections": self.collections[2],
                "gc_total_s": self.total_s, "gc_max_pause_s": max(self.max_seconds)}

    def _on_pass(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed mid-pass
            return
        seconds = time.perf_counter() - self._started
        self._started = None
        generation = min(int(info.get("generation", 2)), 2)
        self.collections[generation] += 1
        self.seconds[generation] += seconds
        self.max_seconds[generation] = max(self.max_seconds[generation], seconds)


def freeze_start_up() -> None:
    """Move what start-up built (model, kernels, graphs), which lives as long as the engine, out of the collector's
    generations, so that a full collection no longer walks it inside somebody's step. combined's MoE run on the H200
    (session 10, 12 req/s) had one 226 ms pause between two steps, outside both, that broke the TBT bound of 189
    requests; a collection is a likely cause, not a proven one (session 14's pauses were 17-18 ms with it)."""
    gc.collect()
    gc.freeze()
