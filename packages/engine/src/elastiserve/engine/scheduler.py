"""Continuous batching: FCFS admission, decodes first, then prefill chunks under the token budget; no torch.

Preemption (by recompute) is the last resort when the pool cannot give a running sequence its next block: the
latest-arrived running sequence is the victim, its KV is freed and it goes back to the front of the waiting queue.
``dry_run`` computes the next step's block demand without touching any state, so control can act before the step.

Priority scheduling (``policy="priority"``, vLLM's and SGLang's ``--scheduling-policy priority``): the queue is kept in
(priority, arrival) order, lowest first; the victim is the running sequence last in that order; and a queued
request that does not fit preempts running ones of a strictly lower priority (a higher number) until it does.
Equal priorities never preempt each other for admission, so the policy is FCFS among them.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastiserve.engine.errors import EngineError
from elastiserve.engine.kv_manager import KVManager
from elastiserve.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from elastiserve.control.admission import BaseFloorBound


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence ``i`` produces a token this step (its chunk reaches the end of its tokens)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens

    def remove(self, seq: Sequence) -> int:
        i = self.seqs.index(seq)
        self.seqs.pop(i)
        return self.num_new_tokens.pop(i)


@dataclass(frozen=True, slots=True)
class StepDemand:
    """What the next step would need, from ``Scheduler.dry_run``."""

    blocks_needed: int
    required_blocks: int  # the part running sequences need (only this justifies preemption)
    free_blocks: int
    num_running: int
    num_waiting: int
    num_decodes: int
    num_prefill_tokens: int

    @property
    def shortage(self) -> int:
        return max(0, self.blocks_needed - self.free_blocks)


SCHEDULING_POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(self, kv: KVManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise EngineError(f"scheduling policy {policy!r}: expected one of {SCHEDULING_POLICIES}")
        self.kv = kv
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The next step's token budget when the engine caps it below max_num_batched_tokens (step_budget.py);
        # decodes are never cut, only prefill chunks and admissions.
        self.step_tokens: int | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.admission: BaseFloorBound[Sequence] | None = None  # an extra admission bound, set by the engine

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """FCFS: at the back (new) or the front (preempted). Priority: at its place in (priority, arrival) order,
        which puts a preempted request, older than those queued behind it at its priority, ahead of them."""
        if not self.by_priority:
            self.waiting.appendleft(seq) if front else self.waiting.append(seq)
            return
        keys = [s.priority_key for s in self.waiting]  # a deque has no bisect; queues are thousands at most
        self.waiting.insert(bisect.bisect_right(keys, seq.priority_key), seq)

    def victim(self) -> Sequence:
        """The running sequence preemption takes first: the latest arrived (priority: the last in service order)."""
        if self.by_priority:
            return max(self.running, key=lambda s: s.priority_key)
        return max(self.running, key=lambda s: s.arrival_time)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def oldest_unanswered_arrival(self) -> float | None:
        """Arrival time of the longest-waiting request that has no output token yet (None: every request has one)."""
        return min((seq.arrival_time for seq in (*self.running, *self.waiting) if seq.num_output_tokens == 0),
                   default=None)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop the request wherever it is and free every block and host slot it holds."""
        seq = self.find(request_id)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free_sequence(seq)
        seq.status = SequenceStatus.ABORTED
        seq.finish_reason = "abort"
        return seq

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free_sequence(seq)
        seq.status = SequenceStatus.FINISHED

    # ---- planning --------------------------------------------------------------------------------------------
    @property
    def token_budget(self) -> int:
        if self.step_tokens is None:
            return self.max_num_batched_tokens
        return min(self.step_tokens, self.max_num_batched_tokens)

    def _running_order(self) -> list[Sequence]:
        decodes, prefills = [], []
        for seq in self.running:
            (prefills if seq.in_prefill else decodes).append(seq)
        return decodes + prefills

    def dry_run(self) -> StepDemand:
        """Block demand of the next step if nothing were preempted; changes nothing."""
        budget, blocks, decodes, prefill_tokens = self.token_budget, 0, 0, 0
        for seq in self._running_order():
            n = 1 if not seq.in_prefill else min(seq.num_uncomputed_tokens, budget)
            if n <= 0:  # decodes take budget first and may use it all
                continue
            blocks += self.kv.blocks_needed(seq, n)
            budget -= n
            decodes += n == 1 and not seq.in_prefill
            prefill_tokens += n if seq.in_prefill else 0
        required = blocks
        num_seqs = len(self.running)
        tally = self.admission.tally(self.running) if self.admission is not None and self.waiting else None
        for seq in self.waiting:
            if budget <= 0 or num_seqs >= self.max_num_seqs or self.held_for_leader(seq):
                break
            if tally is not None and not self.admission.admit(tally, seq):
                break
            n = min(seq.num_uncomputed_tokens - self.kv.cached_prefix_tokens(seq), budget)
            blocks += self.kv.blocks_for(n)  # what the prefix cache already holds is not demanded again
            budget -= n
            prefill_tokens += n
            num_seqs += 1
        return StepDemand(
            blocks, required, self.kv.num_free_blocks(), len(self.running), len(self.waiting), decodes, prefill_tokens
        )

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        limit = self.token_budget
        budget = limit
        for seq in self._running_order():
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            uncomputed = seq.num_uncomputed_tokens
            prefill = uncomputed > 1
            n = min(uncomputed, budget) if prefill else 1
            if n <= 0:  # decodes take budget first and may use it all
                continue
            if prefill:
                n = max(1, self._tokens_that_fit(seq, n))  # shrink a chunk before preempting anyone
            preempted = len(batch.preempted)
            if not self._allocate_or_preempt(seq, n, batch):
                budget = limit - batch.num_tokens
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            # A preemption may have taken scheduled rows out of the batch: count again (summing every time made
            # the loop quadratic in the batch).
            budget = limit - batch.num_tokens if len(batch.preempted) != preempted else budget - n
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def held_for_leader(self, seq: Sequence) -> bool:
        """Whether ``seq`` waits for its prefix leader (``Sequence.prefix_leader``): while the leader is queued or
        still in prefill. It then holds the queue behind it too (FCFS), for at most the leader's prefill. The leader
        stays ahead of it: it was queued first (``LLMEngine.add_request`` takes only a leader it already has, and under
        priority scheduling only one served no later), and only admitted requests, whose leader is cleared, go back
        to the queue's head."""
        leader = None if seq.prefix_leader is None else self.find(seq.prefix_leader)
        return leader is not None and (leader.status is SequenceStatus.WAITING or leader.in_prefill)

    def _allocate_or_preempt(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        while not self.kv.allocate(seq, n):
            victim = self.victim()
            self.preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _tokens_that_fit(self, seq: Sequence, n: int) -> int:
        """``n`` clipped to what the blocks ``seq`` holds plus the free blocks can store."""
        capacity = (len(seq.block_table) + self.kv.num_free_blocks()) * self.kv.block_size
        return max(0, min(n, capacity - seq.num_computed_tokens))

    def preempt(self, victim: Sequence, batch: ScheduledBatch | None = None) -> None:
        """Free the victim's KV and requeue it at the front; its tokens are kept and recomputed later."""
        if batch is not None and victim in batch.seqs:
            batch.remove(victim)
        self.running.remove(victim)
        self.kv.free_sequence(victim)
        victim.reset_for_recompute()
        self._enqueue(victim, front=True)
        self.num_preemptions += 1
        if batch is not None:
            batch.preempted.append(victim)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        tally = self.admission.tally(self.running) if self.admission is not None and self.waiting else None
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:
                if self._preempt_below(seq, batch):  # priority: a slot from a lower-priority request
                    budget = self.token_budget - batch.num_tokens
                    continue
                break
            if self.held_for_leader(seq) or (tally is not None and not self.admission.admit(tally, seq)):
                break
            matched = self.kv.match_prefix(seq)  # cached pairs from the prompt's start are not computed again
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.running:  # alone, a request starts in whatever the pool has
                n = self._tokens_that_fit(seq, n)
            # Otherwise its whole chunk must fit, as in vLLM: admitting a chunk clipped to the last free blocks left
            # partly prefilled requests that decode growth then preempted (the H200 engine preempted static-fp16
            # 2,725 times at concurrency 64 on the 20 GB pool, where the simulator, which waits, preempted 51).
            if n == 0 or not self.kv.allocate(seq, n):
                self.kv.unmatch(seq)
                if self._preempt_below(seq, batch):  # priority: blocks from a lower-priority request, then retry
                    budget = self.token_budget - batch.num_tokens
                    continue
                if not self.running:
                    raise EngineError(
                        f"request {seq.request_id} cannot get a single KV block with nothing running "
                        f"({self.kv.num_free_blocks()} free): the KV pool is too small"
                    )
                break
            self.waiting.popleft()
            seq.prefix_leader = None  # held once only: preempted, it comes back at the queue's head on its own
            self.kv.count_prefix_lookup(seq, matched)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n

    def _preempt_below(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Priority scheduling: preempt the last running sequence in service order if its priority is strictly
        lower than queued ``seq``'s (a higher number); whether one was."""
        if not self.by_priority or not self.running:
            return False
        victim = self.victim()
        if victim.priority <= seq.priority:
            return False
        self.preempt(victim, batch)
        return True
