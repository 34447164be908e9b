"""Priority scheduling (``scheduling_policy="priority"``, vLLM's convention: lower first): the queue in (priority,
arrival) order, a preempted request back at its place in it, the victim the last in that order, and a queued request
that does not fit (blocks or slots) preempting running ones of a strictly lower priority, never equal ones. The
engine refuses a priority under FCFS, and the server passes a request's ``priority`` on (400 under FCFS)."""

from __future__ import annotations

import json

import pytest
from served_app import post_raw
from tiny_models import random_fp16_model, small_llama_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.errors import EngineError, InvalidRequest
from elastiserve.engine.kv_manager import FlatBlockPool, KVManager
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import Scheduler
from elastiserve.engine.sequence import Sequence, SequenceMetrics, SequenceStatus
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]

BS = 4


def make(num_blocks: int = 64, max_seqs: int = 8, budget: int = 64, policy: str = "priority") -> Scheduler:
    kv = KVManager(FlatBlockPool(num_blocks), BS, num_host_slots=0)
    return Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy)


def add(sched: Scheduler, request_id: str, prompt_len: int, arrival: float, priority: int = 0) -> Sequence:
    seq = Sequence(request_id, [1] * prompt_len, prompt_len, SamplingParams(), SequenceMetrics(arrival),
                   priority=priority)
    sched.add(seq)
    return seq


def complete_step(batch, token: int = 5) -> None:
    for i, seq in enumerate(batch.seqs):
        seq.num_computed_tokens += batch.num_new_tokens[i]
        if batch.samples(i):
            seq.token_ids.append(token)


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_the_queue_is_kept_in_priority_then_arrival_order():
    sched = make(max_seqs=1)
    for name, arrival, priority in [("a", 0.0, 5), ("b", 1.0, 0), ("c", 2.0, 5), ("d", 3.0, -1), ("e", 4.0, 0)]:
        add(sched, name, 3, arrival, priority)
    assert ids(sched.waiting) == ["d", "b", "e", "a", "c"]
    fcfs = make(max_seqs=1, policy="fcfs")
    for name, arrival, priority in [("a", 0.0, 5), ("b", 1.0, 0)]:
        add(fcfs, name, 3, arrival, priority)
    assert ids(fcfs.waiting) == ["a", "b"]  # FCFS ignores the field


def test_a_preempted_request_goes_back_to_its_place():
    sched = make(num_blocks=4)
    a = add(sched, "a", 7, 0.0, priority=0)
    b = add(sched, "b", 8, 1.0, priority=1)
    complete_step(sched.schedule())  # a: 2 blocks, b: 2 blocks, the pool is full
    later = add(sched, "later", 3, 2.0, priority=1)  # queued behind... nothing: waiting for room
    batch = sched.schedule()  # a's decode needs a third block: b is the last in service order
    assert batch.preempted == [b] and ids(batch.seqs) == ["a"]
    assert ids(sched.waiting) == ["b", "later"]  # older than `later` at its priority: ahead of it
    assert b.status is SequenceStatus.WAITING and later.status is SequenceStatus.WAITING and a in sched.running


def test_victim_is_the_lowest_priority_not_the_latest_arrival():
    sched = make(num_blocks=4)
    low = add(sched, "low", 7, 0.0, priority=9)
    add(sched, "high", 8, 1.0, priority=0)
    complete_step(sched.schedule())
    assert sched.victim() is low
    batch = sched.schedule()  # high's decode needs a block: the earlier-arrived but lower-priority one goes
    assert batch.preempted == [low] and ids(batch.seqs) == ["high"]
    fcfs = make(num_blocks=4, policy="fcfs")
    add(fcfs, "low", 7, 0.0, priority=9)
    add(fcfs, "high", 8, 1.0, priority=0)
    complete_step(fcfs.schedule())
    assert fcfs.victim().request_id == "high"  # FCFS: the latest arrival


def test_a_higher_priority_arrival_preempts_for_blocks_and_slots_but_equals_wait():
    sched = make(num_blocks=4)
    low = add(sched, "low", 13, 0.0, priority=5)  # all four blocks, with room for three more tokens
    complete_step(sched.schedule())
    same = add(sched, "same", 4, 1.0, priority=5)
    batch = sched.schedule()
    assert not batch.preempted and same.status is SequenceStatus.WAITING  # equal priority: FCFS, it waits
    complete_step(batch)
    urgent = add(sched, "urgent", 4, 2.0, priority=0)
    batch = sched.schedule()
    assert batch.preempted == [low] and urgent in batch.seqs and urgent.status is SequenceStatus.RUNNING
    assert ids(sched.waiting) == ["low", "same"]
    slots = make(max_seqs=1)
    add(slots, "low", 3, 0.0, priority=1)
    complete_step(slots.schedule())
    urgent = add(slots, "urgent", 3, 1.0, priority=0)
    batch = slots.schedule()  # no slot left: the lower-priority running request gives its up
    assert ids(batch.preempted) == ["low"] and ids(slots.running) == ["urgent"]


def test_unknown_policies_are_refused():
    with pytest.raises(EngineError, match="scheduling policy 'lifo'"):
        make(policy="lifo")
    with pytest.raises(ConfigError, match="scheduling_policy='lifo'"):
        EngineConfig(model="m", scheduling_policy="lifo")


def engine(policy: str) -> LLMEngine:
    config = EngineConfig(model="tiny", device="cpu", block_size=4, cpu_kv_blocks=64, max_model_len=128,
                          scheduling_policy=policy)
    return LLMEngine(config, model=random_fp16_model(small_llama_config(2, 128)), eos_token_ids=())


def test_the_engine_serves_by_priority_and_refuses_one_under_fcfs():
    fcfs = engine("fcfs")
    try:
        with pytest.raises(InvalidRequest, match="needs the priority scheduling policy"):
            fcfs.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), priority=3)
        fcfs.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), priority=0)  # 0 is everyone's default
    finally:
        fcfs.close()
    prio = engine("priority")
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        prio.add_request("late", [1, 2, 3], params, arrival_time=0.0, priority=2)
        prio.add_request("first", [4, 5, 6], params, arrival_time=1.0, priority=-1)
        assert ids(prio.scheduler.waiting) == ["first", "late"]
        finished = []
        while prio.has_unfinished():
            finished += [out.request_id for out in prio.step() if out.finished]
        assert sorted(finished) == ["first", "late"]
    finally:
        prio.close()


def test_the_server_passes_priority_on(fake_served):
    body = {"model": "test-model", "prompt": "Hi", "max_tokens": 2, "priority": 1}
    status, error = post_raw(fake_served.url, "/v1/completions", json.dumps(body).encode())
    assert status == 200  # the fake engine takes any priority
    status, error = post_raw(fake_served.url, "/v1/completions", json.dumps(body | {"priority": "high"}).encode())
    assert status == 400 and error["error"]["param"] == "priority"
