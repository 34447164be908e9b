"""What the control plane sees each step (plain numbers) and what it answers; plus the pure pair ranking.

The engine (or the simulator) fills a ``StepObservation`` twice per step: before scheduling, with the demand of a
side-effect-free dry run, and after scheduling, with the free capacity that is left (``F_post`` of ElasticKV: free
blocks minus those already committed to admitted prefills and, by default, to queued prompts that fit).
The control plane decides HOW MUCH to demote / evict / preempt / promote / restore; the caller decides WHICH pairs,
using ``rank_demotable`` so every driver ranks the same way.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from typing import Literal

from elastiserve.platforms import ConfigError

ALL_LAYERS: Literal["all"] = "all"
REQUEST_STATUSES = ("decoding", "prefilling", "waiting", "finishing")


@dataclass(frozen=True, slots=True)
class StepObservation:
    """State of one replica at a step boundary. Blocks are KV blocks; units are VMM units of ``blocks_per_unit``."""

    step: int
    now: float
    free_blocks: int
    total_blocks: int
    native_blocks: int
    demand_blocks: int | None
    required_blocks: int = 0
    blocks_per_unit: int = 1
    backed_units: int = 0
    residual_layers: int = 0
    units_per_layer: int = 0  # a typical layer's residual units (the median): the arbiter's eviction granule
    # Each residual layer's own units, by layer; () = every layer has ``units_per_layer``. Layers differ where some
    # linears stay unnested, and the last one holds a nested lm_head's lower plane too (EngineConfig.nest_lm_head).
    layer_units: tuple[int, ...] = ()
    fast_layers: frozenset[int] = frozenset()
    evicted_layers: frozenset[int] = frozenset()
    restorable_layers: tuple[int, ...] = ()
    free_units: int = 0
    target_pairs_eligible: int = 0
    base_pairs: int = 0
    resident_pairs: int = 0
    base_pairs_promotable: int = 0
    promotions_in_flight: int = 0
    restore_in_flight: bool = False
    transfer_slack: bool = True
    running: int = 0
    waiting: int = 0

    def __post_init__(self) -> None:
        counts = (self.free_blocks, self.total_blocks, self.native_blocks, self.backed_units, self.base_pairs)
        if min(counts) < 0 or self.free_blocks > self.total_blocks:
            raise ConfigError(f"inconsistent observation at step {self.step}: {self}")
        if self.blocks_per_unit < 1:
            raise ConfigError("blocks_per_unit must be >= 1")
        if self.layer_units and (len(self.layer_units) != self.residual_layers or min(self.layer_units) < 0):
            raise ConfigError(f"layer_units {self.layer_units} must give >= 0 units for each of the "
                              f"{self.residual_layers} residual layers")

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def occupancy(self) -> float:
        """Used KV blocks over the FP16 (native) budget: the DPS pressure signal k; may exceed 1 in fast mode."""
        return self.used_blocks / max(1, self.native_blocks)

    @property
    def shortage(self) -> int:
        """ElasticKV Delta_t = max(0, D_t - F_t); zero when the probe was skipped."""
        if self.demand_blocks is None:
            return 0
        return max(0, self.demand_blocks - self.free_blocks)

    @property
    def required_shortage(self) -> int:
        """Blocks missing for work already running (decode growth); only this justifies preemption."""
        return max(0, self.required_blocks - self.free_blocks)

    @property
    def blocks_per_layer(self) -> int:
        return self.units_per_layer * self.blocks_per_unit

    def units_of(self, layer: int) -> int:
        """Residual units of ``layer`` (``layer_units``, else every layer's ``units_per_layer``)."""
        return self.layer_units[layer] if self.layer_units else self.units_per_layer


@dataclass(frozen=True, slots=True)
class Decision:
    """One step's answer. ``evict_residual_layers`` lists decoder layers whose residual units become KV capacity
    ("all" for the whole model). ``preempt`` is the number of blocks the control could not find for running work:
    the scheduler preempts (recompute) until they are free. ``promote_pairs`` is a count of BASE pairs to promote."""

    demote_pairs: int = 0
    evict_residual_layers: tuple[int, ...] | Literal["all"] = ()
    preempt: int = 0
    promote_pairs: int = 0
    start_restore: bool = False
    restore_layers: tuple[int, ...] = ()
    reasons: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if min(self.demote_pairs, self.preempt, self.promote_pairs) < 0:
            raise ConfigError(f"negative amounts in {self}")
        if self.demote_pairs and self.promote_pairs:
            raise ConfigError("a decision must not demote and promote in the same step (oscillation)")
        if self.evict_residual_layers and self.start_restore:
            raise ConfigError("a decision must not evict and restore residuals in the same step")

    @property
    def is_noop(self) -> bool:
        return not (
            self.demote_pairs or self.evict_residual_layers or self.preempt or self.promote_pairs or self.start_restore
        )


NOOP = Decision()


@dataclass(frozen=True, slots=True)
class PairInfo:
    """One TARGET or BASE pair of a sequence, as the ranking needs it."""

    seq_id: int
    pair_index: int
    last_used_step: int
    request_status: str = "decoding"
    has_backing: bool = True
    is_sink: bool = False
    is_recent: bool = False


# Lower rank = demoted first. Requests that are not urgent (still waiting for a prefill chunk, or about to finish)
# go before actively decoding ones, whose every step reads the whole context.
_STATUS_ORDER = {"waiting": 0, "prefilling": 1, "finishing": 2, "decoding": 3}


def is_demotable(pair: PairInfo) -> bool:
    """ElasticKV eligibility: not an attention sink, not a recent-token pair, and recoverable from host backing."""
    return pair.has_backing and not pair.is_sink and not pair.is_recent


def rank_demotable(pairs: list[PairInfo], n: int) -> list[PairInfo]:
    """The ``n`` eligible pairs to demote first: least urgent request status, then least recently used, then the
    oldest pair of the sequence (farthest from the generation front). Deterministic for equal keys."""
    if n <= 0:
        return []
    eligible = (p for p in pairs if is_demotable(p))
    return heapq.nsmallest(n, eligible, key=_demotion_key)


def rank_demotable_streams(streams: Iterable[Iterable[PairInfo]], n: int) -> list[PairInfo]:
    """Same answer as ``rank_demotable`` when every stream (one per sequence) is already in ranking order, as a
    sequence's pairs are (they share status and last use, so pair index decides). Merging lazily touches about
    n + len(streams) pairs instead of all of them."""
    if n <= 0:
        return []
    merged = heapq.merge(*((p for p in s if is_demotable(p)) for s in streams), key=_demotion_key)
    return list(islice(merged, n))


def _demotion_key(p: PairInfo) -> tuple[int, int, int, int]:
    return (_STATUS_ORDER.get(p.request_status, 3), p.last_used_step, p.pair_index, p.seq_id)
