"""One arbiter over KV demotion, residual eviction and preemption, by an explicit cost model.

Each step has two phases (ARCHITECTURE.md, "Modes and steps"):

* ``decide_pressure(obs)`` before scheduling, with the dry-run demand: cover the shortage with the enabled
  mechanisms, cheapest per freed block first (``ArbiterConfig.cost_per_block`` at the expected pressure duration).
  Preemption is a last resort and only for blocks that running work needs; new admissions simply wait.
* ``decide_recovery(obs)`` after scheduling, with the free capacity that is left: undo degradations in reverse order
  of cost (the most expensive first), with ElasticKV's reserve for promotion and DPS's hysteresis for restore.

Presets: static-fp16 = preempt only; static-fp8 = every residual evicted from the start, then preempt;
dps = whole-model residual eviction then preempt; elastickv = demotion then preempt; combined = per-layer eviction,
demotion and preemption ordered by cost.
"""

from __future__ import annotations

from elastiserve.control.config import ControlConfig
from elastiserve.control.kv_fidelity import KVFidelityPolicy
from elastiserve.control.observation import ALL_LAYERS, Decision, StepObservation
from elastiserve.control.precision import PrecisionPolicy, QueuePressure


class Arbiter:
    def __init__(self, config: ControlConfig, a_max: int) -> None:
        self.config = config
        self.kv = KVFidelityPolicy(config.kv, a_max)
        self.precision = PrecisionPolicy(config.precision)
        self.queue = QueuePressure(config.precision)
        self.expected_duration_s = config.arbiter.pressure_duration_s
        self._episode_start: float | None = None
        self._calm_since: float | None = None
        self._shortage_this_step = 0
        self._evicted_this_step = False

    def should_probe(self, free_blocks: int) -> bool:
        """Whether the caller should run the dry run this step (ElasticKV's static capacity guard)."""
        return self.kv.should_probe(free_blocks)

    def skip_pressure(self) -> None:
        """The caller skipped the pressure phase (probe skipped, nothing to evict): same as a no-op decision."""
        self._shortage_this_step = 0
        self._evicted_this_step = False
        self.kv.record_demotion(0, 0)

    def idle_recovery(self, now: float) -> None:
        """Recovery phase when nothing is degraded (no BASE pair, no evicted layer): only the reserve decays."""
        self.kv.plan_promotion(0, 0, 0, False)
        self._track_episode_state(now, degraded=False)

    def run_all_fast(self, now: float, oldest_queued_s: float, queued_prompts: int = 0,
                     carries_prefill: bool = False) -> bool:
        """Once per step, after scheduling: whether the step runs every layer in FP8 for speed (residuals kept;
        ``PrecisionConfig.queue_fast_s`` and ``prefill_fast``). ``oldest_queued_s``: the longest any request has
        waited for its first token; ``queued_prompts``: requests the schedule left waiting with no token scheduled;
        ``carries_prefill``: whether the step runs a prefill chunk."""
        return self.queue.run_all_fast(now, oldest_queued_s, queued_prompts, carries_prefill)

    def mechanism_order(self, blocks_per_layer: int) -> list[str]:
        """Enabled mechanisms, cheapest per freed block first at the current expected pressure duration."""
        cost = self.config.arbiter.cost_per_block
        d = self.expected_duration_s
        granule = {"demote": 1, "evict": max(1, blocks_per_layer), "preempt": 1}
        ranked = sorted(self.config.arbiter.mechanisms, key=lambda m: (cost(m, d, granule[m]), m))
        return ranked

    def decide_pressure(self, obs: StepObservation) -> Decision:
        shortage = obs.shortage
        self._shortage_this_step = shortage
        self._evicted_this_step = False
        remaining, freed = shortage, 0
        demote, evict, preempt, reasons = 0, (), 0, []
        if self.config.precision.static_fast:
            evict = self.precision.plan_eviction(obs, 0)
            if evict:
                reasons.append("static-fp8: all residuals evicted")
                freed += self.precision.freed_blocks(obs, evict)
                remaining = max(0, remaining - freed)
        for mechanism in self.mechanism_order(obs.blocks_per_layer):
            if mechanism == "demote":
                demote = self.kv.plan_demotion(
                    obs.free_blocks + freed, remaining, obs.target_pairs_eligible, obs.base_pairs, obs.resident_pairs
                )
                if demote:
                    reasons.append(f"demote {demote} pairs for shortage {remaining}")
                freed += demote
                remaining = max(0, remaining - demote)
            elif mechanism == "evict" and not evict:
                evict = self.precision.plan_eviction(obs, remaining)
                if evict:
                    got = self.precision.freed_blocks(obs, evict)
                    reasons.append(f"evict {'all' if evict == ALL_LAYERS else len(evict)} residual layers (+{got})")
                    freed += got
                    remaining = max(0, remaining - got)
            elif mechanism == "preempt":
                preempt = max(0, obs.required_shortage - freed)
                if preempt:
                    reasons.append(f"preempt for {preempt} blocks of running work")
        self.kv.record_demotion(demote, shortage)
        self._evicted_this_step = bool(evict)
        return Decision(demote_pairs=demote, evict_residual_layers=evict, preempt=preempt, reasons=tuple(reasons))

    def decide_recovery(self, obs: StepObservation) -> Decision:
        """Promotion and restore after scheduling; call exactly once per step, after ``decide_pressure``."""
        self._track_episode(obs)
        promote = 0
        if self.config.uses_demotion:
            promote = self.kv.plan_promotion(
                obs.free_blocks, obs.base_pairs_promotable, obs.promotions_in_flight, obs.transfer_slack
            )
        restore: tuple[int, ...] = ()
        if self.config.uses_eviction and not self._evicted_this_step:
            calm = self.precision.is_calm(obs, self._shortage_this_step)
            if not calm:
                self._calm_since = None
            elif self._calm_since is None:
                self._calm_since = obs.now
            calm_for = obs.now - self._calm_since if self._calm_since is not None else 0.0
            restore = self.precision.plan_restore(obs, self._shortage_this_step, calm_for)
        else:
            self._calm_since = None
        if restore and promote:
            # Reverse order of cost: recover the dearer degradation first, the cheaper one on a later step.
            cost = self.config.arbiter.cost_per_block
            d = self.expected_duration_s
            if cost("demote", d, 1) >= cost("evict", d, max(1, obs.blocks_per_layer)):
                restore = ()
            else:
                promote = 0
        if restore and obs.free_blocks - obs.blocks_per_layer < 2 * promote:
            restore = ()
        reasons = []
        if promote:
            reasons.append(f"promote {promote} pairs (reserve {self.kv.reserve})")
        if restore:
            reasons.append(f"restore layer {restore[0]} (occupancy {obs.occupancy:.2f})")
        return Decision(
            promote_pairs=promote, start_restore=bool(restore), restore_layers=restore, reasons=tuple(reasons)
        )

    def _track_episode(self, obs: StepObservation) -> None:
        """Expected pressure duration: EWMA of the time from first degradation to full recovery."""
        degraded = obs.base_pairs > 0 or bool(obs.evicted_layers and not self.config.precision.static_fast)
        self._track_episode_state(obs.now, degraded)

    def _track_episode_state(self, now: float, degraded: bool) -> None:
        if degraded and self._episode_start is None:
            self._episode_start = now
        elif not degraded and self._episode_start is not None:
            length = max(now - self._episode_start, 1e-6)
            w = self.config.arbiter.duration_ewma
            self.expected_duration_s = (1 - w) * self.expected_duration_s + w * length
            self._episode_start = None
