"""Control policies scripted by the test, for engine tests that need a mode switch or a pair transition at a known
step."""

from __future__ import annotations

from elastiserve.control.observation import NOOP, Decision


class EvictThenRestore:
    """Evict every residual (whole model to fast) at one step; ask for restores from a later step on."""

    def __init__(self, evict_at: int, restore_from: int) -> None:
        self.evict_at, self.restore_from = evict_at, restore_from

    def decide_pressure(self, obs):
        return Decision(evict_residual_layers="all") if obs.step == self.evict_at else NOOP

    def decide_recovery(self, obs):
        wanted = obs.step >= self.restore_from and bool(obs.evicted_layers) and not obs.restore_in_flight
        return Decision(start_restore=True) if wanted else NOOP


class ScriptedPolicy:
    """Demote every eligible pair, or promote every BASE pair, at the step after the test asks for it."""

    def __init__(self) -> None:
        self.demote_next = self.promote_next = False

    def decide_pressure(self, obs):
        wanted, self.demote_next = self.demote_next, False
        return Decision(demote_pairs=obs.target_pairs_eligible) if wanted else NOOP

    def decide_recovery(self, obs):
        wanted, self.promote_next = self.promote_next, False
        return Decision(promote_pairs=obs.base_pairs_promotable) if wanted else NOOP


def snapshot_pairs(engine, request_id):
    """Clones of the KV blocks of each demotable pair of a request, by pair index (to compare after promotion)."""
    seq = engine.scheduler.find(request_id)
    kv = engine.runner.kv_cache
    return {p: (kv[seq.block_table[2 * p]].clone(), kv[seq.block_table[2 * p + 1]].clone())
            for p in engine.kv.demotable_pairs(seq)}  # fmt: skip
