"""The garbage collector's passes, timed, so that a pause between two steps can be told apart from the steps.

On the H200 (session 14, MoE headline, dps at 24 and 27 req/s, 3,072-token chunks) the engine's host time between
two steps was 2.1 ms at the median and 5.0 ms at P99 of ~790 steps, but one gap per run, about 6 s in, took 17-18 ms
with ~130 requests running (four runs of two calls; one run had a second, 10.8 ms at 11 s). Added to a 112 ms step
it made a 129 ms gap, over the 123 ms TBT bound of the 131 requests running through it (52.0 % attainment). The
watch records every pass (generation, seconds), and the engine puts the collector's seconds into each step's record
(``gc_s``), next to ``step_s``, for the bench timelines. Session 15 read them: the collector ran 0.7 ms in that
step (21 ms over the run); the gap was the residual eviction's bookkeeping (``SumState.evict_layers``, since done in
bulk: 7.6 ms).

On a GPU the engine also moves the collector's passes into the device's shadow (``take_over``): automatic
collection is off, and the runner calls ``collect_due`` right after it has queued a step's forward, where the host
would only wait for the device (a 112 ms MoE step against 2 ms of host work), so a pass no longer sits between two
steps. The thresholds stay CPython's, so a pass runs as often as it would have, only at that point.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

_holders = 0  # watches that hold automatic collection (take_over) now
_was_enabled = True  # whether it was on before the first of them took it


@dataclass(slots=True)
class GcWatch:
    """Counts and times the collector's passes through ``gc.callbacks`` while installed."""

    collections: list[int] = field(default_factory=lambda: [0, 0, 0])  # per generation
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    max_seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _started: float | None = None
    _installed: bool = False
    _thresholds: tuple[int, int, int] | None = None  # set while the watch has taken automatic collection over

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_pass)
            self._installed = True

    def remove(self) -> None:
        self.release()
        if self._installed:
            gc.callbacks.remove(self._on_pass)
            self._installed = False

    def take_over(self) -> None:
        """Turn automatic collection off; ``collect_due`` runs the passes it would have run. ``release`` (or
        ``remove``) gives it back; several watches may hold it at once (it comes back when the last lets go)."""
        global _holders
        if self._thresholds is None:
            self._thresholds = gc.get_threshold()[:3]
            if _holders == 0:
                global _was_enabled
                _was_enabled = gc.isenabled()
            _holders += 1
            gc.disable()

    def release(self) -> None:
        global _holders
        if self._thresholds is not None:
            self._thresholds = None
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()

    @property
    def owns_collection(self) -> bool:
        return self._thresholds is not None

    def collect_due(self) -> int | None:
        """Run the pass CPython would run now (the oldest generation whose count passed its threshold, checked only
        once the youngest's allocations have passed theirs); its generation, or None when none is due."""
        if self._thresholds is None:
            return None
        counts, limits = gc.get_count(), self._thresholds
        if limits[0] == 0 or counts[0] <= limits[0]:
            return None
        generation = max(g for g in range(3) if g == 0 or counts[g] > limits[g])
        gc.collect(generation)
        return generation

    @property
    def total_s(self) -> float:
        return sum(self.seconds)

    def stats(self) -> dict[str, float | int]:
        return {"gc_collections": sum(self.collections), "gc_full_collections": self.collections[2],
                "gc_total_s": self.total_s, "gc_max_pause_s": max(self.max_seconds),
                "gc_in_step_shadow": self.owns_collection}

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
