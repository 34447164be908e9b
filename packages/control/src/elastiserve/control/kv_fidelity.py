"""ElasticKV Algorithm 1: shortage-driven batched demotion and reserve-aware promotion (plus the ablations).

Per step t, with free blocks F_t and the dry-run demand D_t:

    Delta_t = max(0, D_t - F_t)                      (the probe is skipped, Delta_t = 0, when F_t > A_max)
    if Delta_t > 0:  n_d = min(|eligible|, max(Delta_t, B_min));  E_t = max(0, |B_d| - Delta_t)
    after scheduling: R_t = max(0, R_{t-1} - lambda) + E_t;  P_t = max(0, F_post - R_t)
    promote eligible BASE pairs within P_t, only with transfer slack.

In this design a promotion unpacks into two fresh blocks and frees the packed one only when it publishes, so a pair
transiently needs 2 free blocks: the pair budget is P_t // 2.
Ablations (paper App. C.7): ``watermark`` demotes when F_t falls below a fixed watermark; ``eager`` sets the reserve
to zero in the budget; ``none`` never promotes.
"""

from __future__ import annotations

import math

from elastiserve.control.config import KVFidelityConfig
from elastiserve.platforms import ConfigError

BLOCKS_PER_PROMOTION = 2


def capacity_guard(max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> int:
    """A_max = max(N_req, ceil(N_tok / B)): the most blocks one step can ask for. Above it, skip the probe."""
    if min(max_num_seqs, max_num_batched_tokens, block_size) < 1:
        raise ConfigError("capacity guard needs positive N_req, N_tok and block size")
    return max(max_num_seqs, math.ceil(max_num_batched_tokens / block_size))


def demotion_count(shortage: int, eligible: int, b_min: int) -> int:
    """n_d = min(|P_d|, max(Delta_t, B_min)) when Delta_t > 0, else 0."""
    if shortage <= 0:
        return 0
    return min(eligible, max(shortage, b_min))


def surplus(demoted: int, shortage: int) -> int:
    """E_t = max(0, |B_d| - Delta_t): capacity released beyond the current shortage."""
    return max(0, demoted - shortage)


def next_reserve(previous: int, decay: int, surplus_blocks: int) -> int:
    """R_t = max(0, R_{t-1} - lambda) + E_t."""
    return max(0, previous - decay) + surplus_blocks


def promotion_budget(free_after_scheduling: int, reserve: int) -> int:
    """P_t = max(0, F_post - R_t), in blocks."""
    return max(0, free_after_scheduling - reserve)


class KVFidelityPolicy:
    """Stateful wrapper: carries the reserve R and the surplus E of the current step between the two phases.

    Call ``plan_demotion`` before scheduling, ``record_demotion`` with what was actually demoted, then
    ``plan_promotion`` after scheduling, exactly once per step (the reserve decays there).
    """

    def __init__(self, config: KVFidelityConfig, a_max: int) -> None:
        if a_max < 0:
            raise ConfigError(f"a_max must be >= 0, got {a_max}")
        self.config = config
        self.a_max = a_max
        self.reserve = 0
        self._surplus = 0

    def should_probe(self, free_blocks: int) -> bool:
        """Static capacity guard: the dry run is skipped when more than A_max blocks are free."""
        return free_blocks <= self.a_max

    def base_cap_room(self, base_pairs: int, resident_pairs: int) -> int:
        """How many more pairs may turn BASE under ``max_base_fraction``."""
        if self.config.max_base_fraction >= 1.0:
            return resident_pairs
        return max(0, math.floor(self.config.max_base_fraction * resident_pairs) - base_pairs)

    def wanted_blocks(self, free_blocks: int, shortage: int) -> int:
        """Blocks the trigger asks demotion to free: the shortage, or (watermark variant) the gap to the watermark."""
        if self.config.demotion_trigger == "watermark":
            return max(shortage, self.config.watermark - free_blocks)
        return shortage

    def plan_demotion(
        self, free_blocks: int, shortage: int, eligible: int, base_pairs: int, resident_pairs: int
    ) -> int:
        """Number of TARGET pairs to demote this step (each frees one block)."""
        wanted = self.wanted_blocks(free_blocks, shortage)
        room = self.base_cap_room(base_pairs, resident_pairs)
        return min(demotion_count(wanted, eligible, self.config.b_min), room)

    def record_demotion(self, demoted: int, shortage: int) -> None:
        """E_t from the pairs actually demoted against the shortage they answered."""
        self._surplus = surplus(demoted, shortage)

    def plan_promotion(
        self, free_after_scheduling: int, promotable: int, in_flight: int, transfer_slack: bool
    ) -> int:
        """Advance the reserve one step and return the number of BASE pairs to start promoting."""
        self.reserve = next_reserve(self.reserve, self.config.reserve_decay, self._surplus)
        self._surplus = 0
        if self.config.promotion == "none" or not transfer_slack:
            return 0
        protected = 0 if self.config.promotion == "eager" else self.reserve
        budget_blocks = promotion_budget(free_after_scheduling, protected)
        slots = max(0, self.config.max_promotions_in_flight - in_flight)
        return min(budget_blocks // BLOCKS_PER_PROMOTION, promotable, slots)
