"""Control policies scripted by step number, for engine tests that need a mode switch at a known step."""

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
