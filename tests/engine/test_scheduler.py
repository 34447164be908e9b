"""Pins the scheduler: FCFS admission, decodes before prefill chunks under the token budget, max_num_seqs,
preemption by recompute of the latest-arrived running request as the last resort, a side-effect-free dry run
that predicts the next step's block demand, and that aborts free every block."""

from __future__ import annotations

import pytest

from elastiserve.engine.errors import EngineError
from elastiserve.engine.kv_manager import FlatBlockPool, KVManager
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import Scheduler
from elastiserve.engine.sequence import Sequence, SequenceMetrics, SequenceStatus

pytestmark = [pytest.mark.cpu]

BS = 4


def make(num_blocks: int = 64, max_seqs: int = 8, budget: int = 32) -> Scheduler:
    kv = KVManager(FlatBlockPool(num_blocks), BS, num_host_slots=0)
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget)


def add(sched: Scheduler, request_id: str, prompt_len: int, arrival: float) -> Sequence:
    seq = Sequence(request_id, [1] * prompt_len, prompt_len, SamplingParams(), SequenceMetrics(arrival))
    sched.add(seq)
    return seq


def complete_step(batch, token: int = 5) -> None:
    """What the engine's postprocess does to the sequences (without stop checks)."""
    for i, seq in enumerate(batch.seqs):
        sample = batch.samples(i)
        seq.num_computed_tokens += batch.num_new_tokens[i]
        if sample:
            seq.token_ids.append(token)


def test_chunked_prefill_respects_token_budget_and_fcfs():
    sched = make(budget=10)
    a, b = add(sched, "a", 7, 0.0), add(sched, "b", 9, 1.0)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a", "b"] and batch.num_new_tokens == [7, 3]
    assert batch.samples(0) and not batch.samples(1)
    complete_step(batch)
    batch = sched.schedule()
    # a decodes first (1 token), then b's remaining prefill chunk
    assert [s.request_id for s in batch.seqs] == ["a", "b"] and batch.num_new_tokens == [1, 6]
    assert batch.samples(1)
    complete_step(batch)
    assert a.num_output_tokens == 2 and b.num_output_tokens == 1


def test_max_num_seqs_limits_admission():
    sched = make(max_seqs=2, budget=100)
    for i in range(3):
        add(sched, f"r{i}", 3, float(i))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["r0", "r1"] and len(sched.waiting) == 1


def test_dry_run_predicts_schedule_without_side_effects():
    sched = make(budget=12)
    add(sched, "a", 8, 0.0)
    add(sched, "b", 9, 1.0)
    complete_step(sched.schedule())
    before = (len(sched.running), len(sched.waiting), sched.kv.num_free_blocks())
    demand = sched.dry_run()
    assert (len(sched.running), len(sched.waiting), sched.kv.num_free_blocks()) == before
    free = sched.kv.num_free_blocks()
    sched.schedule()
    assert free - sched.kv.num_free_blocks() == demand.blocks_needed
    assert demand.required_blocks <= demand.blocks_needed and demand.shortage == 0


def test_preemption_picks_latest_arrival_and_recomputes():
    sched = make(num_blocks=4, budget=64)
    add(sched, "a", 7, 0.0)
    b = add(sched, "b", 8, 1.0)
    complete_step(sched.schedule())  # a: 8 tokens (2 blocks), b: 9 tokens (2 blocks + needs a third)
    assert sched.kv.num_free_blocks() == 0
    batch = sched.schedule()
    assert batch.preempted == [b] and b.status is SequenceStatus.WAITING and b.metrics.preemptions == 1
    assert [s.request_id for s in batch.seqs] == ["a"]
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.num_output_tokens == 1
    assert sched.waiting[0] is b and sched.num_preemptions == 1
    complete_step(batch)
    assert sched.dry_run().blocks_needed >= 0


def test_victim_can_be_the_requester_itself():
    sched = make(num_blocks=2, budget=64)
    a = add(sched, "a", 8, 0.0)
    complete_step(sched.schedule())
    batch = sched.schedule()  # a needs a third block and is the only (hence latest) running sequence
    assert batch.is_empty and batch.preempted == [a]
    batch = sched.schedule()  # re-admission: 9 tokens do not fit 2 blocks, the chunk that fits (8) is admitted
    assert batch.seqs == [a] and batch.num_new_tokens == [8] and not batch.samples(0)


def test_pool_too_small_for_any_progress_raises():
    sched = make(num_blocks=1, budget=64)
    hog = Sequence("hog", [1] * 4, 4, SamplingParams(), SequenceMetrics(0.0))
    assert sched.kv.allocate(hog, 4)  # the only block is held outside the scheduler
    add(sched, "a", 3, 1.0)
    with pytest.raises(EngineError, match="too small"):
        sched.schedule()


def test_abort_frees_blocks_wherever_the_request_is():
    sched = make(num_blocks=8, budget=64)
    a = add(sched, "a", 10, 0.0)
    add(sched, "b", 30, 1.0)
    complete_step(sched.schedule())
    c = add(sched, "c", 5, 2.0)
    assert sched.abort("c") is c and c.status is SequenceStatus.ABORTED
    assert sched.abort("a") is a and a.block_table == []
    assert sched.abort("missing") is None
    sched.abort("b")
    assert sched.kv.num_free_blocks() == 8 and not sched.has_unfinished()


def test_base_floor_admission_stops_fcfs_and_the_dry_run_alike():
    """kv.admission = "base-floor": a request is admitted (and counted in the probed demand) only while all admitted
    ones fit at prompt + max_tokens with unprotected pairs in BASE (hand-computed below)."""
    from dataclasses import replace

    from elastiserve.control.config import preset

    control = preset("elastickv")
    control = replace(control, kv=replace(control.kv, admission="base-floor", b_min=1))
    kv = KVManager(FlatBlockPool(20), BS, num_host_slots=64, sink_pairs=1, recent_pairs=1)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    sched.admission = kv.admission_bound(control, max_model_len=1000)
    # Each request: 16 prompt + 16 max tokens = 32 tokens = 8 blocks = 4 pairs, 2 protected -> floor 8 - 2 = 6
    # blocks. Capacity 20 less headroom min(2 x b_min, 20 // 16) = 1 -> 19: three fit (18), a fourth (24) does not.
    seqs = []
    for i in range(4):
        seq = Sequence(f"r{i}", [1] * 16, 16, SamplingParams(max_tokens=16), SequenceMetrics(float(i)))
        sched.add(seq)
        seqs.append(seq)
    demand = sched.dry_run()
    assert demand.blocks_needed == 3 * 4  # three prompts of 4 blocks are probed; the fourth would break the floor
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["r0", "r1", "r2"] and [s.request_id for s in sched.waiting] == ["r3"]
    assert kv.admission_bound(preset("elastickv"), 1000) is None  # the simulator's default, "free": no bound
