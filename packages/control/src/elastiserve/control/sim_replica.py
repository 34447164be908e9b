"""One simulated serving replica: continuous batching, FCFS, chunked prefill under a token budget, preemption by
recompute, and the control plane (``Arbiter``) deciding demotion / eviction / promotion / restore each step.

Host->device traffic goes through one in-order H2D copy queue (``h2d_free_at``): promotion low bytes, residual
restores, and each step's own input upload (token ids, positions, block tables). The runner uploads a step's inputs
before it issues the copies decided in the previous round, so those copies overlap the step's forward pass; the
next step's upload waits for whatever is still in flight. Promotion therefore costs step time only when the bytes
queued in one round take longer than a step to move (a queue can't reorder past them). Once a promotion's copy has
landed, the next step runs its unpack kernel (launch + 4 blocks of HBM traffic per pair, in the step time) and
publishes the pair; until then it holds its two fresh blocks as well as the packed one."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import chain, islice

from elastiserve.control.admission import BaseFloorBound
from elastiserve.control.arbiter import Arbiter
from elastiserve.control.config import ControlConfig
from elastiserve.control.events import EventLog
from elastiserve.control.kv_fidelity import capacity_guard
from elastiserve.control.metrics import ExposureMeter, ModeMeter, RequestRecord
from elastiserve.control.observation import ALL_LAYERS, Decision, StepObservation, rank_demotable_streams
from elastiserve.control.pool import KVPoolModel, make_pool
from elastiserve.control.precision import layers_to_run_fast
from elastiserve.control.sim_recovery import TransferRecovery
from elastiserve.control.sim_sequence import SimSequence
from elastiserve.control.step_budget import StepBudget, StepBudgetConfig, probe_token_counts
from elastiserve.control.step_model import StepModel, padded_batch, prefill_key_count
from elastiserve.control.workloads import Request
from elastiserve.platforms import ConfigError


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    native_blocks: int = 4096
    block_size: int = 16
    residual_layers: int = 32
    units_per_layer: int = 104
    blocks_per_unit: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    pool: str = "auto"
    max_step_time_s: float | None = None  # cap prefill chunks to keep steps under it, per mode (step_budget.py)

    def __post_init__(self) -> None:
        if self.native_blocks < 1 or self.block_size < 1 or self.blocks_per_unit < 1:
            raise ConfigError("native_blocks, block_size and blocks_per_unit must be >= 1")
        if self.units_per_layer < 1 or self.residual_layers < 0:
            raise ConfigError("units_per_layer must be >= 1 and residual_layers >= 0")
        if self.native_blocks % self.blocks_per_unit:
            raise ConfigError("native_blocks must be a whole number of units")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("need max_num_seqs >= 1 and a token budget of at least one token per sequence")
        if self.max_step_time_s is not None:
            StepBudgetConfig(self.max_step_time_s, self.max_num_batched_tokens)  # validates


class Replica(TransferRecovery):
    def __init__(self, rc: ReplicaConfig, control: ControlConfig, step_model: StepModel,
                 pool: KVPoolModel | None = None) -> None:
        self.rc, self.control, self.sm = rc, control, step_model
        self.pool = pool or make_pool(rc.pool, rc.native_blocks // rc.blocks_per_unit, rc.residual_layers,
                                      rc.units_per_layer, rc.blocks_per_unit)
        a_max = capacity_guard(rc.max_num_seqs, rc.max_num_batched_tokens, rc.block_size)
        self.arbiter = Arbiter(control, a_max)
        self.allow_backed = control.uses_eviction
        self.now, self.step = 0.0, 0
        self.waiting: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []
        self.records: list[RequestRecord] = []
        self.events = EventLog()
        self.exposure = ExposureMeter()
        self.modes = ModeMeter(rc.residual_layers)
        self.h2d_free_at = 0.0
        self._upload_barrier = 0.0  # when the H2D queue frees up for the next step's input upload
        self.restoring: tuple[int, float] | None = None
        self.promotions: list[tuple[float, SimSequence, int]] = []
        self._was_fast = False
        self._running_fast: frozenset[int] = frozenset()
        self._queue_fast = False  # this step runs every layer fast for a queue, not for memory
        self._deferred_fast = None  # a switch to fewer fast layers that waits for a step planned for it
        self.h2d_stall_s = 0.0
        self._preempted_now: set[int] = set()
        self.step_budget = None if rc.max_step_time_s is None else StepBudget(
            StepBudgetConfig(rc.max_step_time_s, rc.max_num_batched_tokens))
        if self.step_budget is not None:
            self._prime_step_budget()
        kv = control.kv  # kv.admission: "free" admits anything the free blocks hold; see control.admission
        self._bound = None if kv.admission == "free" else BaseFloorBound(
            self.pool.total_blocks if control.uses_eviction else self.pool.native_blocks,
            lambda s: s.request.prompt_tokens + min(s.request.output_tokens, kv.admission_output_clip), rc.block_size,
            kv.sink_pairs + kv.recent_pairs, headroom_blocks=2 * kv.b_min)

    def _prime_step_budget(self) -> None:
        """As the engine's probe after warm-up (engine/step_probe.py): one prefill-only step per probe size in each
        whole-model mode, timed by the step model."""
        num_layers = self.pool.num_layers
        for layers in (0, num_layers) if self.allow_backed else (0,):
            fast = layers / max(1, num_layers)
            self.step_budget.prime(layers, [(t, self.sm.step_time(t, t, fast_fraction=fast, nested=self.allow_backed,
                                                                  prefill_keys=prefill_key_count(0, t)))
                                            for t in probe_token_counts(self.rc.max_num_batched_tokens)])

    # ---- intake ---------------------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        record = RequestRecord(request.req_id, request.arrival, request.prompt_tokens, request.output_tokens)
        self.records.append(record)
        self.waiting.append(SimSequence(request, record))

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.promotions or self.restoring)

    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    # ---- observation ------------------------------------------------------------------------------------------
    def _oldest_queued_s(self) -> float:
        """The longest any request has waited for its first token (0 when none waits): the queue-pressure signal,
        computed only when the configuration uses it (the queue rule; prefill_fast alone does not read it)."""
        if not self.arbiter.queue.enabled or self.control.precision.queue_fast_s is None:
            return 0.0
        waiting = (s.record.arrival for s in (*self.waiting, *self.running) if s.generated == 0)
        return max(0.0, self.now - min(waiting, default=self.now))

    def _plan(self) -> tuple[int, int, list[tuple[SimSequence, int]]]:
        """Dry run of the scheduler without memory limits: (required blocks, total demand, prefill chunks)."""
        bs = self.rc.block_size
        budget = self.rc.max_num_batched_tokens
        if self.step_budget is not None:  # the mode of the last step, or a deferred one: the engine's choice too
            mode = self.pool.num_layers if self.control.precision.prefill_fast else len(self._running_fast)
            budget = self.step_budget.plan_tokens(mode, self._deferred_fast)  # prefill_fast: chunks run all fast
        required, chunks = 0, []
        for seq in self.running:
            if seq.computed >= seq.prefill_target:  # decoding: a new block exactly when the last one is full
                required += seq.computed >= len(seq.blocks) * bs
                budget -= 1
        admissions = 0
        slots = self.rc.max_num_seqs - len(self.running)
        tally = self._bound.tally(self.running) if self._bound is not None and self.waiting else None
        for seq in chain([s for s in self.running if s.prefilling], self.waiting):
            if budget <= 0:
                break
            is_new = seq.state == "waiting"
            if is_new:
                if slots <= 0 or (tally is not None and not self._bound.admit(tally, seq)):
                    break
                slots -= 1
            chunk = min(seq.remaining_prompt, budget)
            need = seq.blocks_needed(chunk, bs)
            budget -= chunk
            chunks.append((seq, chunk))
            if is_new:
                admissions += need
            else:
                required += need
        if self.control.demand_counts_admissions:
            return required, required + admissions, chunks
        return required, required, chunks

    def _may_evict(self) -> bool:
        """Whether the eviction policy could act without a probed shortage (high-occupancy trigger, static FP8)."""
        if not self.control.uses_eviction or len(self.pool.evicted_layers()) == self.pool.num_layers:
            return False
        used = self.pool.total_blocks() - self.pool.free_block_count()
        return used > 0.9 * self.control.precision.kappa_high * self.pool.native_blocks() or \
            self.control.precision.static_fast

    def _needs_pair_detail(self, demand: int | None) -> bool:
        """Counting eligible pairs walks every running sequence: do it only when demotion could be asked for."""
        if not self.control.uses_demotion:
            return False
        free = self.pool.free_block_count()
        kv = self.control.kv
        if kv.demotion_trigger == "watermark" and free < kv.watermark:
            return True
        return demand is not None and demand > free

    def _committed_blocks(self) -> int:
        """Capacity that progress already needs: the rest of admitted prefills and the prompts of queued requests that
        would fit in free sequence slots."""
        bs = self.rc.block_size
        committed = sum(s.remaining_prefill_blocks(bs) for s in self.running)
        slots = max(0, self.rc.max_num_seqs - len(self.running))
        return committed + sum(-(-s.prefill_target // bs) for s in islice(self.waiting, slots))

    def _restorable(self, evicted: frozenset[int]) -> tuple[int, ...]:
        """Restorable layers, asked of the pool only when the precision policy could restore at all."""
        if not evicted or self.restoring or self.control.precision.static_fast:
            return ()
        used = self.pool.total_blocks() - self.pool.free_block_count()
        if used >= self.control.precision.kappa_low * self.pool.native_blocks():
            return ()
        return self.pool.plan_restore()

    def observe(self, demand: int | None, required: int, detail: bool = False, f_post: bool = False) -> StepObservation:
        """With ``f_post`` the free count is ElasticKV's F_post under ``KVFidelityConfig.f_post``: free blocks, less
        the committed ones under the "committed" rule (promotion is opportunistic and must not take them)."""
        bs, kv = self.rc.block_size, self.control.kv
        eligible = resident = 0
        if detail:
            eligible = sum(s.eligible_pairs(bs, kv.sink_pairs, kv.recent_pairs) for s in self.running)
            resident = sum(s.complete_pairs(bs) for s in self.running)
        base = sum(len(s.base_pairs) for s in self.running) if self.control.uses_demotion else 0
        promoting = sum(len(s.promoting) for s in self.running) if self.promotions else 0
        evicted = self.pool.evicted_layers()
        free = self.pool.free_block_count()
        if f_post and kv.f_post == "committed":
            free = max(0, free - self._committed_blocks())
        return StepObservation(
            step=self.step, now=self.now, free_blocks=free,
            total_blocks=self.pool.total_blocks(), native_blocks=self.pool.native_blocks(),
            demand_blocks=demand, required_blocks=required, blocks_per_unit=self.pool.blocks_per_unit,
            backed_units=self.pool.backed_units(), residual_layers=self.pool.num_layers,
            units_per_layer=self.pool.units_per_layer, fast_layers=evicted, evicted_layers=evicted,
            restorable_layers=self._restorable(evicted), free_units=self.pool.free_units(),
            target_pairs_eligible=eligible, base_pairs=base, resident_pairs=resident,
            base_pairs_promotable=base - promoting, promotions_in_flight=len(self.promotions),
            restore_in_flight=self.restoring is not None,
            transfer_slack=len(self.promotions) < kv.max_promotions_in_flight,
            running=len(self.running), waiting=len(self.waiting),
        )

    # ---- applying decisions -----------------------------------------------------------------------------------
    def _apply_pressure(self, d: Decision) -> int:
        if d.evict_residual_layers:
            layers = range(self.pool.num_layers) if d.evict_residual_layers == ALL_LAYERS else d.evict_residual_layers
            todo = [x for x in layers if x not in self.pool.evicted_layers()]
            self.pool.evict_layers(todo)
            self.events.add(self.now, self.step, "evict_residual", len(todo), "; ".join(d.reasons))
        demoted = 0
        if d.demote_pairs:
            kv, bs = self.control.kv, self.rc.block_size
            streams = [s.pair_infos(bs, kv.sink_pairs, kv.recent_pairs) for s in self.running]
            by_id = {s.seq_id: s for s in self.running}
            chosen = rank_demotable_streams(streams, d.demote_pairs)
            released = [by_id[p.seq_id].demote(p.pair_index) for p in chosen]
            self.pool.free_blocks(released)
            demoted = len(released)
            self.events.add(self.now, self.step, "demote", demoted, "; ".join(d.reasons))
        return demoted

    def _preempt_last(self) -> SimSequence:
        victim = self.running.pop()
        self._release(victim)
        victim.reset_for_recompute()
        victim.state = "waiting"
        self.waiting.appendleft(victim)
        self._preempted_now.add(victim.seq_id)
        self.events.add(self.now, self.step, "preempt", 1, "allocation failed for running work")
        return victim

    def _release(self, seq: SimSequence) -> None:
        if seq.promoting:
            self.promotions = [p for p in self.promotions if p[1] is not seq]
        self.pool.free_blocks(seq.physical_blocks())

    def _alloc(self, seq: SimSequence, n: int) -> bool:
        if n == 0:
            return True
        evicted_before = len(self.pool.evicted_layers()) if self.allow_backed else 0
        got = self.pool.alloc_blocks(n, allow_backed=self.allow_backed)
        if got is None:
            return False
        if self.allow_backed and len(self.pool.evicted_layers()) > evicted_before:
            self.events.add(self.now, self.step, "evict_residual", 1, "allocation took a BACKED unit")
        seq.blocks.extend(got)
        return True

    def _alloc_running(self, seq: SimSequence, n: int) -> bool:
        """Allocate for running work, preempting the newest running sequences (recompute) until it fits."""
        while not self._alloc(seq, n):
            victim = self._preempt_last()
            if victim is seq:
                return False
        return True

    def _schedule(
        self, chunks: list[tuple[SimSequence, int]]
    ) -> tuple[list[SimSequence], list[tuple[SimSequence, int]]]:
        bs, decodes = self.rc.block_size, []
        self._preempted_now: set[int] = set()
        for seq in list(self.running):
            if seq.state != "running" or seq.computed < seq.prefill_target:
                continue
            need = 1 if seq.computed >= len(seq.blocks) * bs else 0
            if need == 0 or self._alloc_running(seq, need):
                decodes.append(seq)
        prefills, tally = [], None
        for seq, chunk in chunks:
            if seq.state == "running":
                if not self._alloc_running(seq, seq.blocks_needed(chunk, bs)):
                    continue
                prefills.append((seq, chunk))
                continue
            if seq.seq_id in self._preempted_now or not self.waiting or self.waiting[0] is not seq:
                break  # preempted this step, or no longer at the head: FCFS stops here
            if self._bound is not None:
                if tally is None:  # running chunks come first: this step's preemptions are already out
                    tally = self._bound.tally(self.running)
                if not self._bound.admit(tally, seq):
                    break
            if self._alloc(seq, seq.blocks_needed(chunk, bs)):
                self.waiting.popleft()
                seq.state = "running"
                self.running.append(seq)
            else:
                break  # FCFS: later requests wait too
            prefills.append((seq, chunk))
        # A later allocation may have preempted a sequence scheduled earlier in this step.
        decodes = [s for s in decodes if s.state == "running"]
        prefills = [(s, c) for s, c in prefills if s.state == "running"]
        return decodes, prefills

    # ---- one step -----------------------------------------------------------------------------------------------
    def run_step(self) -> bool:
        """One scheduling step; returns False when nothing could run (the caller advances time)."""
        landed = self._complete_transfers()
        required, demand, chunks = self._plan()
        probe = self.arbiter.should_probe(self.pool.free_block_count())
        probed = demand if probe else None
        demoted = 0
        kv = self.control.kv
        watermark_low = kv.demotion_trigger == "watermark" and self.pool.free_block_count() < kv.watermark
        if probed is None and not watermark_low and not self._may_evict():
            self.arbiter.skip_pressure()
        else:
            obs = self.observe(probed, required, self._needs_pair_detail(probed))
            demoted = self._apply_pressure(self.arbiter.decide_pressure(obs))
        decodes, prefills = self._schedule(chunks)
        self._queue_fast = self.arbiter.run_all_fast(self.now, self._oldest_queued_s(), len(self.waiting),
                                                     bool(prefills))
        self._note_mode()
        if not decodes and not prefills:
            self._upload_barrier = self.h2d_free_at
            self._recover()
            return False  # promotions that landed were unpacked on an idle GPU: no step pays for them
        self._execute(decodes, prefills, demoted, landed)
        self._upload_barrier = self.h2d_free_at
        self._recover()
        self.step += 1
        return True

    def _execute(
        self, decodes: list[SimSequence], prefills: list[tuple[SimSequence, int]], demoted: int, unpacked: int
    ) -> None:
        bs = self.rc.block_size
        batch = decodes + [s for s, _ in prefills]
        prefill_tokens = sum(c for _, c in prefills)
        prefill_keys = sum(prefill_key_count(s.computed, c) for s, c in prefills)
        context = prefill_tokens + len(decodes)
        base_ctx = base_read = pairs_read = 0
        step = self.step
        for s in batch:
            context += s.computed
            s.last_used_step = step
            pairs = (len(s.blocks) + 1) // 2
            pairs_read += pairs
            s.record.pair_reads += pairs
            if s.base_pairs:
                base = len(s.base_pairs)
                base_read += base
                base_ctx += min(s.computed, 2 * bs * base)
                s.record.base_pair_reads += base
        # The layers that run fast, as the engine picks them (whole model together under DPS, groups per layer).
        wanted = layers_to_run_fast(self.pool.evicted_layers(), self._running_fast, self.pool.num_layers,
                                    self.control.precision)
        if self._queue_fast:  # precision as compute: every layer fast, residuals kept
            wanted = frozenset(range(self.pool.num_layers))
        tokens = len(decodes) + prefill_tokens
        self._deferred_fast = None
        if (self.step_budget is not None and prefills and wanted < self._running_fast
                and self.step_budget.defers(len(self._running_fast), len(wanted), tokens)):
            self._deferred_fast = len(wanted)  # this step keeps its faster mode; the next is planned for the slower
        else:
            self._running_fast = wanted
        fast_layers = len(self._running_fast)
        fast = fast_layers / max(1, self.pool.num_layers)
        # The step's input upload queues behind the H2D bytes issued before it (earlier rounds' copies).
        upload_wait = max(0.0, self._upload_barrier - self.now)
        # A decode-only step replays the CUDA graph of its padded batch; one with a prefill chunk runs eagerly.
        rows = 0 if prefills else padded_batch(len(decodes), self.rc.max_num_seqs)
        dt = upload_wait + self.sm.step_time(tokens, context, base_ctx, fast, demoted, unpacked,
                                             nested=self.control.uses_eviction, padded_rows=rows,
                                             prefill_keys=prefill_keys)
        if self.step_budget is not None and prefills:
            self.step_budget.record(fast_layers, tokens, dt - upload_wait)
        self.exposure.add(dt, base_read, pairs_read)
        self.modes.add(dt, fast_layers)
        self.h2d_stall_s += upload_wait
        self.now += dt
        for s in decodes:
            s.computed += 1
            self._emit(s)
        for s, chunk in prefills:
            s.computed += chunk
            if s.computed >= s.prefill_target:
                self._emit(s)

    def _emit(self, seq: SimSequence) -> None:
        seq.generated += 1
        seq.record.token_times.append(self.now)
        if seq.generated >= seq.request.output_tokens:
            seq.record.finish = self.now
            seq.state = "done"
            self.running.remove(seq)
            self._release(seq)

    def _note_mode(self) -> None:
        fast = bool(self._running_fast)
        if fast != self._was_fast:
            self.events.add(self.now, self.step, "mode_fast" if fast else "mode_full", 1, "batch-aligned switch")
            self._was_fast = fast
