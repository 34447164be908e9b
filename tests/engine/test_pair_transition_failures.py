"""Pair transitions that fail to start lose nothing. A promotion (``ModelRunner.start_promote`` -> ``PromotionFailed``
-> ``KVManager.cancel_promote``): the chunks already enqueued finish as usual, the pairs of the chunk that raised and
of every later one stay BASE with their host slots, their reserved blocks go back to the pool, the request decodes on,
and a later promotion brings every pair back bit-exactly. A demotion that fails before its pack kernel is enqueued
(``DemotionFailed`` -> ``KVManager.cancel_demote``) leaves those pairs TARGET on their own blocks, bytes untouched;
one that fails after packing a block in place cannot be undone and is an ``EngineError``, as is one that fails on
rank 0 under tensor parallelism (the other ranks packed every pair already)."""

from __future__ import annotations

import pytest
import torch
from test_engine_e2e import demoted_request, promote_and_finish, request_with_pairs, tiny_llama  # noqa: F401

from elastiserve.engine import runner as runner_module
from elastiserve.engine.errors import EngineError
from elastiserve.engine.sequence import PairState

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def no_block_leaked(engine, seq) -> bool:
    """Every block not free is the sequence's (a BASE pair's packed block is listed twice) or reserved by a
    promotion in flight."""
    owned = set(seq.block_table)
    for op in engine.kv.promotions_in_flight():
        owned |= {op.dst_a, op.dst_b}
    return engine.kv.pool.num_free(False) == engine.kv.pool.num_blocks - len(owned)


def step_until_target(engine, seq) -> None:
    for _ in range(50):  # published at a later step boundary, once the copy + unpack event has completed
        if not engine.kv.promotions_in_flight():
            return
        engine.step()
    assert not engine.kv.promotions_in_flight()


def test_a_promotion_that_fails_to_start_keeps_base_and_loses_nothing(tiny_llama, device, monkeypatch):  # noqa: F811
    engine, policy, seq, before = demoted_request(tiny_llama, device)
    assert no_block_leaked(engine, seq)

    monkeypatch.setattr(runner_module, "TRANSFER_CHUNK_PAIRS", 1)  # a chunk per pair: the second one fails
    real_promote, calls = engine.runner.ops.kv_promote, []

    def promote_then_fail(*args):
        calls.append(len(calls))
        if len(calls) >= 2:
            raise RuntimeError("out of memory for the staging copy")
        return real_promote(*args)

    monkeypatch.setattr(engine.runner.ops, "kv_promote", promote_then_fail)
    policy.promote_next = True
    engine.step()  # starts the promotion; the first pair is in flight, the rest fail to start
    pairs = sorted(before)
    assert seq.pair_states[pairs[0]] in (PairState.PROMOTING, PairState.TARGET)
    assert [seq.pair_states[p] for p in pairs[1:]] == [PairState.BASE] * (len(pairs) - 1)
    amounts = engine.events.amounts()
    assert amounts["promote_failed"] == len(pairs) - 1 and amounts["promote_start"] == 1
    failed = [e for e in engine.events.events if e.kind == "promote_failed"]
    assert "out of memory" in failed[0].reason
    step_until_target(engine, seq)
    assert seq.pair_states[pairs[0]] is PairState.TARGET
    assert no_block_leaked(engine, seq)  # the failed pairs' two reserved blocks each went back to the pool
    engine.step()  # decoding goes on over the BASE pairs
    assert no_block_leaked(engine, seq)

    monkeypatch.setattr(engine.runner.ops, "kv_promote", real_promote)
    policy.promote_next = True
    engine.step()
    promote_and_finish(engine, seq, before, 20)
    assert engine.kv.pool.num_free(False) == engine.kv.pool.num_blocks and engine.kv.num_free_slots > 0
    assert engine.stats()["promoting_pairs"] == 0


def test_a_demotion_that_fails_to_start_leaves_the_rest_target_and_untouched(tiny_llama, device, monkeypatch):  # noqa: F811
    engine, policy, seq, before = request_with_pairs(tiny_llama, device)
    slots = engine.kv.num_free_slots
    monkeypatch.setattr(runner_module, "TRANSFER_CHUNK_PAIRS", 1)  # a chunk per pair: the second one fails
    real_inputs, calls = engine.runner._demote_inputs, []

    def fail_second_chunk(chunk):
        calls.append(len(chunk))
        if len(calls) >= 2:
            raise RuntimeError("out of memory for the block indices")
        return real_inputs(chunk)

    monkeypatch.setattr(engine.runner, "_demote_inputs", fail_second_chunk)
    policy.demote_next = True
    engine.step()
    pairs = sorted(before)
    assert seq.pair_states[pairs[0]] is PairState.BASE
    assert [seq.pair_states[p] for p in pairs[1:]] == [PairState.TARGET] * (len(pairs) - 1)
    kv = engine.runner.kv_cache
    for p in pairs[1:]:  # their own two blocks, bytes as before
        a, b = before[p]
        assert torch.equal(kv[seq.block_table[2 * p]], a) and torch.equal(kv[seq.block_table[2 * p + 1]], b)
    amounts = engine.events.amounts()
    assert amounts["demote"] == 1 and amounts["demote_failed"] == len(pairs) - 1
    assert engine.kv.num_free_slots == slots - 1 and engine.stats()["base_pairs"] == 1
    assert no_block_leaked(engine, seq)

    monkeypatch.setattr(engine.runner, "_demote_inputs", real_inputs)
    engine.step()
    policy.promote_next = True
    engine.step()
    promote_and_finish(engine, seq, before, 20)
    assert engine.kv.pool.num_free(False) == engine.kv.pool.num_blocks and engine.kv.num_free_slots == slots


def test_a_demotion_that_fails_after_packing_is_an_engine_error(tiny_llama, device, monkeypatch):  # noqa: F811
    engine, policy, _, _ = request_with_pairs(tiny_llama, device)

    def pack_then_fail(*args):
        raise RuntimeError("the copy out failed")

    monkeypatch.setattr(engine.runner.ops, "kv_demote", pack_then_fail)
    policy.demote_next = True
    with pytest.raises(EngineError, match="after packing blocks in place"):
        engine.step()


@pytest.mark.cpu
def test_under_tensor_parallelism_a_demotion_failed_on_rank_0_is_an_error(monkeypatch):
    """The other ranks replay the broadcast demotion in full before rank 0 fails part way: rank 0 cannot take its
    pairs back without the ranks' KV diverging, so the failure is a ``TPError``, not a rollback."""
    from types import SimpleNamespace

    from elastiserve.engine import tp
    from elastiserve.engine.errors import DemotionFailed

    sent = []
    monkeypatch.setattr(tp, "_broadcast", lambda group, plan: sent.append(plan.method))

    def demote(ops):
        raise DemotionFailed(ops[:1], ops[1:], RuntimeError("out of memory"))

    pool = SimpleNamespace(block_pool=SimpleNamespace(num_blocks=8, state=None))
    runner = tp.TPRunner(SimpleNamespace(pool=pool, demote=demote), group=None)
    with pytest.raises(tp.TPError, match="after every other rank started it"):
        runner.demote(["a", "b"])
    assert sent == ["demote"]
