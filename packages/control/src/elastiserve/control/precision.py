"""DPS precision policy (section IV-D): evict residual weights into KV under pressure, restore with hysteresis.

The policy is stateless: the evicted layers, restorable layers and occupancy come in the observation, and changes
apply between steps (batch-aligned). Whole-model granularity flips every layer to fast at once, the DPS design;
per-layer granularity evicts only the k lowest resident layers whose own units cover the shortage (k =
ceil(shortage_units / units_per_layer) where layers are alike; at least ``min_evict_layers``, rounded up to whole
``layer_groups``). Restore goes one layer at a time, the last evicted first, only when occupancy < kappa_low, no
shortage is pending, that layer's units are all FREE, and at least ``restore_min_free_units`` more units than that
layer's stay free.

``QueuePressure`` is the one stateful piece: the compute side of precision (``PrecisionConfig.queue_fast_s`` and
``prefill_fast``).
"""

from __future__ import annotations

import math
from typing import Literal

from elastiserve.control.config import PrecisionConfig
from elastiserve.control.observation import ALL_LAYERS, StepObservation


def layers_covering(shortage_blocks: int, blocks_per_unit: int, units: list[int]) -> int:
    """The fewest leading layers of ``units`` (residual units each, in eviction order) whose units cover the
    shortage; all of them when none do (k = ceil(shortage_units / units) where every layer has the same units)."""
    if shortage_blocks <= 0:
        return 0
    shortage_units = math.ceil(shortage_blocks / blocks_per_unit)
    covered = 0
    for k, layer_units in enumerate(units, start=1):
        covered += layer_units
        if covered >= shortage_units:
            return k
    return len(units)


class QueuePressure:
    """Whether the next step runs every layer fast for speed rather than memory: on once the oldest request without
    a first token has waited ``queue_fast_s``; while on, a step that leaves prompts queued (not admitted at all)
    keeps it on; off ``queue_fast_hold_s`` after the last step that saw either. The queued prompts are what keeps it
    on because the wait alone released it mid-burst on the H200 (session 12, MoE headline, dps at 21 req/s): fast
    mode had drained every old request, the 2 s hold ran out at t = 3.98 s with 11 prompts just queued, the next
    full-mode step took 132 ms with 74 requests running (TBT bound 123 ms), and 0.43 s later the wait had turned
    it on again. With ``prefill_fast`` a step that carries a prefill chunk runs fast too; it touches no hold."""

    def __init__(self, config: PrecisionConfig) -> None:
        self.config = config
        self._high_at: float | None = None

    @property
    def enabled(self) -> bool:
        return (self.config.queue_fast_s is not None or self.config.prefill_fast) and not self.config.static_fast

    def run_all_fast(self, now: float, oldest_queued_s: float, queued_prompts: int = 0,
                     carries_prefill: bool = False) -> bool:
        """``oldest_queued_s``: the longest any request has waited for its first token; ``queued_prompts``: how
        many requests this step's schedule left waiting without a single token scheduled; ``carries_prefill``:
        whether the step runs a prefill chunk."""
        if not self.enabled:
            return False
        if self.config.queue_fast_s is None:
            return carries_prefill
        on = self._high_at is not None and now - self._high_at <= self.config.queue_fast_hold_s
        if oldest_queued_s >= self.config.queue_fast_s or (on and queued_prompts > 0):
            self._high_at = now
        held = self._high_at is not None and now - self._high_at <= self.config.queue_fast_hold_s
        return held or (self.config.prefill_fast and carries_prefill)


class PrecisionPolicy:
    def __init__(self, config: PrecisionConfig) -> None:
        self.config = config

    def resident_layers(self, obs: StepObservation) -> list[int]:
        return [layer for layer in range(obs.residual_layers) if layer not in obs.evicted_layers]

    def over_high_watermark(self, obs: StepObservation) -> bool:
        """Whole model: occupancy of the FP16 budget above kappa_high. Per layer: occupancy of what is mapped now
        (otherwise every evicted layer would leave the signal high and the next step would evict another)."""
        if self.config.granularity == "model":
            return obs.occupancy > self.config.kappa_high
        return obs.used_blocks > self.config.kappa_high * obs.total_blocks

    def plan_eviction(self, obs: StepObservation, shortage_blocks: int) -> tuple[int, ...] | Literal["all"]:
        """Layers whose residual units become KV capacity this step, or ``()``."""
        resident = self.resident_layers(obs)
        if not resident:
            return ()
        if self.config.static_fast:
            return ALL_LAYERS
        pressured = shortage_blocks > 0 or self.over_high_watermark(obs)
        if not pressured:
            return ()
        if self.config.granularity == "model":
            return ALL_LAYERS
        k = max(self.config.min_evict_layers, layers_covering(shortage_blocks, obs.blocks_per_unit,
                                                              [obs.units_of(layer) for layer in resident]))
        # A group runs fast whole once one of its layers is stale (``layers_to_run_fast``): evicting the rest of
        # it frees their units at no further quality cost.
        groups = whole_groups(frozenset(resident[:k]), obs.residual_layers, self.config.layer_groups)
        return tuple(layer for layer in resident if layer in groups)

    def freed_blocks(self, obs: StepObservation, layers: tuple[int, ...] | Literal["all"]) -> int:
        """KV blocks the eviction adds (residual units of layers that are still resident)."""
        chosen = self.resident_layers(obs) if layers == ALL_LAYERS else layers
        return sum(obs.units_of(layer) for layer in chosen) * obs.blocks_per_unit

    def is_calm(self, obs: StepObservation, shortage_blocks: int) -> bool:
        """Below the low threshold with nothing short: the condition whose duration the dwell measures."""
        return shortage_blocks <= 0 and obs.occupancy < self.config.kappa_low

    def plan_restore(self, obs: StepObservation, shortage_blocks: int, calm_for_s: float = math.inf) -> tuple[int, ...]:
        """At most one layer to restore now (``()`` when the hysteresis, dwell or free-unit conditions fail)."""
        if self.config.static_fast or obs.restore_in_flight or shortage_blocks > 0:
            return ()
        if calm_for_s < self.config.restore_dwell_s:
            return ()
        if not obs.evicted_layers or obs.occupancy >= self.config.kappa_low:
            return ()
        # Last evicted, first restored: eviction takes the lowest resident layers, so the fast set stays a prefix
        # of the layers and the engine meets at most num_layers + 1 mixes (each one its own decode graphs).
        for layer in sorted(obs.restorable_layers, reverse=True):
            if layer in obs.evicted_layers:
                enough = obs.free_units >= obs.units_of(layer) + self.config.restore_min_free_units
                return (layer,) if enough else ()
        return ()


def layers_to_run_fast(stale: frozenset[int], running_fast: frozenset[int], num_layers: int,
                       config: PrecisionConfig) -> frozenset[int]:
    """The layers the next step runs in FP8: every layer whose residual is stale, widened so that the runner meets
    few distinct mixes of full and fast layers (each new mix captures its graphs inside a step unless it was
    captured before serving). Whole-model granularity switches all layers together, as DPS does: fast as soon as any
    residual is stale, full once all are restored. Per layer, restored layers return to full only
    ``min_evict_layers`` at a time (or all together when nothing is stale), and whole ``layer_groups`` run fast
    together. On the H200 MoE run the restore switched one layer back at a time: dps met 22 mixes (27-48 fast
    layers of 48) at its 12 req/s point."""
    if not stale:
        return frozenset()
    if config.granularity == "model":
        return frozenset(range(num_layers))
    returning = running_fast - stale
    wanted = running_fast | stale if returning and len(returning) < config.min_evict_layers else stale
    return whole_groups(wanted, num_layers, config.layer_groups)


def group_size(num_layers: int, layer_groups: int) -> int:
    return max(1, -(-num_layers // layer_groups))


def whole_groups(layers: frozenset[int], num_layers: int, layer_groups: int) -> frozenset[int]:
    """Every layer of each group that holds one of ``layers`` (groups: ``layer_groups`` contiguous runs)."""
    size = group_size(num_layers, layer_groups)
    groups = {layer // size for layer in layers}
    return frozenset(layer for layer in range(num_layers) if layer // size in groups)


def group_prefixes(num_layers: int, config: PrecisionConfig) -> list[frozenset[int]]:
    """The fast-layer sets a policy meets while eviction and restore stay in order (lowest layers evicted first,
    last evicted restored first): all full, whole-model fast, and per layer each prefix of whole groups."""
    if config.granularity == "model":
        return [frozenset(), frozenset(range(num_layers))]
    size = group_size(num_layers, config.layer_groups)
    ends = sorted({min(num_layers, k * size) for k in range(config.layer_groups + 1)})
    return [frozenset(range(end)) for end in ends]
