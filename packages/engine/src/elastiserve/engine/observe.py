"""Read-only views of a running engine: the control plane's ``StepObservation`` and the ``stats()`` dictionary.

Both only read the scheduler, the KV manager and the runner's mode and unit books; nothing here changes state.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from elastiserve.engine.kv_manager import KVManager
from elastiserve.engine.scheduler import Scheduler, StepDemand


def observe_step(step: int, kv: KVManager, scheduler: Scheduler, runner: Any, demand: StepDemand | None,
                 count_admissions: bool = True) -> Any:
    """The ``StepObservation`` a policy decides on; ``demand`` is the scheduler's dry run (None: not probed), whose
    admissions count in D_t only with ``count_admissions`` (`ControlConfig.demand_counts_admissions`)."""
    from elastiserve.control.observation import StepObservation

    state = runner.pool.block_pool.state
    running = scheduler.running
    per_layer = state.residual_layers()
    eligible = sum(kv.num_demotable_pairs(s) for s in running) if kv.num_free_slots else 0
    counts = kv.counts()
    base = counts["base_pairs"]
    blocks_per_unit = max(1, len(state.unit_blocks(0)))
    return StepObservation(
        step=step,
        now=time.monotonic(),
        free_blocks=counts["free_blocks"],
        # The policies' terms: total = what KV can use now (blocks of units that hold a resident residual are not
        # KV's), native = the FP16 budget, what KV has with every residual resident. Counting residual-held blocks
        # as used made DPS read an empty SmolLM2 pool as 30x occupied and evict every layer at the first step.
        total_blocks=counts["kv_blocks"],
        native_blocks=max(0, counts["total_blocks"] - sum(per_layer.values()) * blocks_per_unit),
        demand_blocks=None if demand is None else demand.blocks_needed if count_admissions else demand.required_blocks,
        required_blocks=0 if demand is None else demand.required_blocks,
        blocks_per_unit=blocks_per_unit,
        backed_units=state.num_backed_units(),
        residual_layers=len(per_layer),
        units_per_layer=statistics.median_low(per_layer.values()) if per_layer else 0,
        layer_units=tuple(per_layer[layer] for layer in sorted(per_layer)),  # the last one holds a nested lm_head's
        fast_layers=runner.fast_layers,
        evicted_layers=state.fast_layers,
        restorable_layers=tuple(sorted(state.fast_layers)),
        free_units=state.num_free_units(),
        target_pairs_eligible=min(eligible, kv.num_free_slots),
        base_pairs=base,
        resident_pairs=sum(len(s.pair_states) for s in running),
        base_pairs_promotable=kv.num_promotable_pairs(running) if base else 0,
        promotions_in_flight=len(kv.promotions_in_flight()),
        restore_in_flight=bool(state.restoring_tasks()),
        running=len(running),
        waiting=len(scheduler.waiting),
    )


def engine_stats(step: int, kv: KVManager, scheduler: Scheduler, runner: Any, events: Any) -> dict[str, Any]:
    """What ``LLMEngine.stats()`` reports (the Prometheus exporter turns every numeric field into a gauge)."""
    counts = kv.counts()
    cache = kv.prefix_cache
    if cache is not None:  # cumulative prompt tokens looked up and found, and the pairs the cache holds now
        counts |= {"prefix_cache_queried_tokens": cache.queried_tokens, "prefix_cache_hit_tokens": cache.hit_tokens,
                   "prefix_cache_pairs": len(cache), "prefix_cache_retained_blocks": cache.num_retained_blocks}
    return {
        **counts,
        "kv_usage": 1.0 - counts["free_blocks"] / max(1, counts["kv_blocks"]),  # of what KV can use now
        "base_exposure": kv.exposure.ratio,
        "fast_layers": sorted(runner.fast_layers),
        "num_layers": runner.model_config.num_hidden_layers,
        "mode": "fast" if runner.fast_layers else "full",
        "transitions": events.counts(),
        "preemptions": scheduler.num_preemptions,
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "steps": step,
    }
