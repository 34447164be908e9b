"""What the engine does with the control plane's answers, between steps: demote and promote pairs, evict and restore
weight residuals, preempt, and choose the layers the next step runs in FP8. Plain bookkeeping here; the device work
(pair kernels, restore copies, the layers' mode) goes through the runner, and every transition becomes an event."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from elastiserve.control.precision import layers_to_run_fast
from elastiserve.engine.config import EngineConfig
from elastiserve.engine.errors import DemotionFailed, PromotionFailed
from elastiserve.engine.kv_manager import KVManager
from elastiserve.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class Transitions:
    """``policy``: the control plane (its ``run_all_fast`` is asked once per step when ``queue_fast_after_s`` or
    ``prefill_fast`` is set); ``precision``: its ``PrecisionConfig``, or None for scripted test policies (the stale
    layers run fast); ``seq_index``: request id -> the integer id the pair ranking uses."""

    def __init__(self, config: EngineConfig, kv: KVManager, scheduler: Scheduler, runner: Any, events: Any,
                 policy: Any, precision: Any, seq_index: dict[str, int], num_layers: int) -> None:
        self.config, self.kv, self.scheduler, self.runner, self.events = config, kv, scheduler, runner, events
        self.policy, self.precision, self.seq_index, self.num_layers = policy, precision, seq_index, num_layers
        self.restore_layers: tuple[int, ...] | None = None  # a restore the control asked for, not started yet
        self.queue_fast = False  # this step runs every layer fast for the queue, not for memory
        self.deferred_fast: int | None = None  # a switch to this many fast layers waits for a step budgeted for it

    def apply(self, decision: Any, step: int) -> None:
        reason = "; ".join(decision.reasons)
        if decision.demote_pairs:
            self.demote(decision.demote_pairs, step, reason)
        if decision.evict_residual_layers:
            self._evict(decision.evict_residual_layers, step, reason)
        if decision.preempt:
            self._preempt_blocks(decision.preempt, step, reason)
        if decision.promote_pairs:
            self.promote(decision.promote_pairs, step, reason)
        if decision.start_restore:
            self.restore_layers = tuple(decision.restore_layers)
            self.events.add(time.monotonic(), step, "restore_start", len(decision.restore_layers), reason)

    def demote(self, num_pairs: int, step: int, reason: str = "") -> int:
        """Demote up to ``num_pairs`` eligible pairs (ranked like the simulator ranks them); returns the count.

        Each sequence's pairs come lazily, already in ranking order, and are merged: building and sorting every
        eligible pair instead (~9,000 at concurrency 64 on the 20 GB pool) took ~20 ms of Python per demotion on
        the CPU, and on the H200 a step that demoted took 6 ms more than one that did not."""
        from elastiserve.control.observation import rank_demotable_streams

        running = self.scheduler.running
        by_id = {self.seq_index[s.request_id]: s for s in running}
        streams = [self.kv.demotion_stream(s, self.seq_index[s.request_id]) for s in running]
        chosen = rank_demotable_streams(streams, min(num_pairs, self.kv.num_free_slots))
        ops = [self.kv.demote(by_id[info.seq_id], info.pair_index) for info in chosen]
        if not ops:
            return 0
        try:
            self.runner.demote(ops)
        except DemotionFailed as failure:  # what did not start is TARGET again; the rest is demoted as usual
            for op in reversed(failure.failed):  # slots back to the front in their order
                self.kv.cancel_demote(self.scheduler.find(op.request_id), op)
            log.warning("%s; those pairs stay TARGET", failure)
            self.events.add(time.monotonic(), step, "demote_failed", len(failure.failed), str(failure.cause))
            ops = failure.started
        if ops:
            self.kv.release_demoted(ops)
            self.events.add(time.monotonic(), step, "demote", len(ops), reason)
        return len(ops)

    def promote(self, num_pairs: int, step: int, reason: str = "") -> int:
        """Start promoting up to ``num_pairs`` BASE pairs (blocks reserved now, published when the copy is done)."""
        ops = []
        for seq, pair in itertools.islice(self.kv.promotion_candidates(self.scheduler.running), num_pairs):
            op = self.kv.begin_promote(seq, pair)
            if op is None:
                break
            ops.append(op)
        if not ops:
            return 0
        try:
            self.runner.start_promote(ops)
        except PromotionFailed as failure:  # what did not start stays BASE; the pairs in flight finish as usual
            for op in failure.failed:
                self.kv.cancel_promote(self.scheduler.find(op.request_id), op)
            log.warning("%s; those pairs stay BASE", failure)
            self.events.add(time.monotonic(), step, "promote_failed", len(failure.failed), str(failure.cause))
            ops = failure.started
        if ops:
            self.events.add(time.monotonic(), step, "promote_start", len(ops), reason)
        return len(ops)

    def publish_promotions(self, step: int) -> None:
        done = 0
        for op in self.runner.poll_promotions():
            seq = self.scheduler.find(op.request_id)
            if seq is not None and self.kv.is_promoting(op):  # not one abandoned with a preempted sequence
                self.kv.finish_promote(seq, op)
                done += 1
        if done:
            self.events.add(time.monotonic(), step, "promote_done", done)

    def restore_between_steps(self, step: int) -> None:
        """Commit residual restores that finished (layers go back to full in ``sync_mode``), start requested ones.
        ``restore_done`` counts the layers whose last stale chunk landed in this commit: a layer restored over
        several steps' commits is done once (the H200 runs had two done events per started layer before)."""
        report = self.runner.between_steps(self.restore_layers)
        if not report.deferred:  # a deferred step started nothing: the requested restore waits for the next one
            self.restore_layers = None
        if report.committed:
            stale = self.runner.pool.block_pool.state.fast_layers
            restored = {task.chunk.layer for task in report.committed} - stale
            if restored:
                self.events.add(time.monotonic(), step, "restore_done", len(restored))

    def _evict(self, layers, step: int, reason: str) -> None:
        state = self.runner.pool.block_pool.state
        chosen = sorted(state.residual_layers()) if layers == "all" else list(layers)
        chosen = [layer for layer in chosen if layer not in state.fast_layers]
        if chosen:
            self.runner.evict_layers(chosen)
            self.events.add(time.monotonic(), step, "evict_residual", len(chosen), reason)

    def _preempt_blocks(self, num_blocks: int, step: int, reason: str) -> None:
        """Preempt running requests, the scheduler's victims first, until ``num_blocks`` more blocks are free."""
        target = self.kv.num_free_blocks() + num_blocks
        while self.scheduler.running and self.kv.num_free_blocks() < target:
            self.scheduler.preempt(self.scheduler.victim())
            self.events.add(time.monotonic(), step, "preempt", 1, reason)

    def update_queue_fast(self, carries_prefill: bool) -> None:
        """Whether this step runs every layer fast for the queue or its prefill chunks
        (``EngineConfig.queue_fast_after_s``, ``prefill_fast``)."""
        if self.config.queue_fast_after_s is None and not self.config.prefill_fast:
            return
        now = time.monotonic()
        # The wait is a scan of every sequence: only the queue rule reads it, not prefill_fast alone.
        oldest = None if self.config.queue_fast_after_s is None else self.scheduler.oldest_unanswered_arrival()
        self.queue_fast = self.policy.run_all_fast(now, 0.0 if oldest is None else now - oldest,
                                                   len(self.scheduler.waiting), carries_prefill)

    def sync_mode(self, step: int, defers=None) -> None:
        """Layers whose residual went stale (allocation took a BACKED unit, or eviction) run fast from this step, and
        every layer while the queue asks for it. ``defers(wanted)``: whether a switch to ``wanted`` fast layers
        waits a step, because this step's tokens were budgeted for the faster mode (``StepBudget.defers``)."""
        self.kv.pool.drain_stale_layers()
        stale = self.runner.pool.block_pool.state.fast_layers
        # Retained prefix-cache blocks would hold the FREE units a residual restore needs (static-fp8 never restores)
        self.kv.set_cache_retention(not stale or self.config.policy == "static-fp8")
        if self.precision is not None:
            stale = layers_to_run_fast(stale, self.runner.fast_layers, self.num_layers, self.precision)
        wanted = stale | self.runner.forced_fast_layers
        if self.config.policy == "static-fp8" or self.queue_fast:
            wanted = frozenset(range(self.num_layers))
        self.deferred_fast = None
        if wanted == self.runner.fast_layers:
            return
        entered, left = wanted - self.runner.fast_layers, self.runner.fast_layers - wanted
        if left and not entered and defers is not None and defers(len(wanted)):
            self.deferred_fast = len(wanted)
            return
        self.runner.set_fast_layers(wanted)
        now = time.monotonic()
        if entered:
            self.events.add(now, step, "mode_fast", len(entered))
        if left:
            self.events.add(now, step, "mode_full", len(left))


def make_policy(config: EngineConfig):
    """The control package's arbiter for ``config.policy``, with the engine's admission rule."""
    from elastiserve.control.arbiter import Arbiter
    from elastiserve.control.config import preset
    from elastiserve.control.kv_fidelity import capacity_guard

    a_max = capacity_guard(config.max_num_seqs, config.max_num_batched_tokens, config.block_size)
    # D_t counts the prompts the next step would admit, as the paper's dry run of the native scheduler does (H200,
    # quarter-scale dense, concurrency 48: 0 preemptions, P90 TTFT 1.03 s; static-fp16 755, 9.88 s), bounded by the
    # base-floor admission: packages/control/README.md, "Demand and admissions".
    control = preset(config.policy).with_engine_admission()
    if config.queue_fast_after_s is not None:
        hold = {} if config.queue_fast_hold_s is None else {"queue_fast_hold_s": config.queue_fast_hold_s}
        control = control.with_precision(queue_fast_s=config.queue_fast_after_s, **hold)
    if config.prefill_fast:
        control = control.with_precision(prefill_fast=True)
    return Arbiter(control, a_max)
