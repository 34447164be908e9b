"""Pins the KV manager's bookkeeping: pair states (TARGET / BASE / PROMOTING), which pairs are protected from
demotion (sinks, recent pairs, the partly filled last pair), host-slot accounting, exposure, and that no physical
block is ever lost or double-owned across allocate / demote / promote / free, on Algorithm 1's unit books."""

from __future__ import annotations

import random

import pytest

from elastiserve.control.events import EventLog
from elastiserve.engine.errors import EngineError
from elastiserve.engine.kv_manager import FlatBlockPool, KVManager, SumBlockPool
from elastiserve.engine.pair_states import PairStates
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.sequence import PairState, Sequence, SequenceMetrics
from elastiserve.engine.transitions import Transitions
from elastiserve.memory.sum_state import SumState

pytestmark = [pytest.mark.cpu]

BS = 4


def make_seq(request_id: str, num_tokens: int, arrival: float = 0.0) -> Sequence:
    return Sequence(request_id, list(range(num_tokens)), num_tokens, SamplingParams(), SequenceMetrics(arrival))


def sum_pool(num_units: int = 8, blocks_per_unit: int = 3) -> SumBlockPool:
    units = [list(range(u * blocks_per_unit, (u + 1) * blocks_per_unit)) for u in range(num_units)]
    return SumBlockPool(SumState(units))


def filled(kv: KVManager, seq: Sequence) -> Sequence:
    assert kv.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    return seq


def owned_blocks(kv: KVManager, seqs: list[Sequence]) -> list[int]:
    blocks = [b for s in seqs for b in set(s.block_table)]
    blocks += [b for op in kv.promotions_in_flight() for b in (op.dst_a, op.dst_b)]
    return blocks


def assert_no_block_lost(kv: KVManager, seqs: list[Sequence]) -> None:
    owned = owned_blocks(kv, seqs)
    assert len(owned) == len(set(owned)), "a physical block is owned twice"
    assert len(owned) + kv.pool.num_free(False) == kv.pool.num_blocks


def test_allocate_grows_block_table_and_pairs():
    kv = KVManager(sum_pool(), BS, num_host_slots=4)
    seq = make_seq("a", 9)
    assert kv.blocks_needed(seq, 9) == 3
    assert kv.allocate(seq, 9)
    assert len(seq.block_table) == 3 and seq.pair_states == [PairState.TARGET] * 2
    seq.num_computed_tokens = 9
    assert kv.blocks_needed(seq, 3) == 0 and kv.blocks_needed(seq, 4) == 1


def test_allocation_failure_changes_nothing():
    kv = KVManager(FlatBlockPool(2), BS, num_host_slots=0)
    seq = make_seq("a", 9)
    assert not kv.allocate(seq, 9)
    assert seq.block_table == [] and kv.pool.num_free() == 2


@pytest.mark.parametrize(("num_tokens", "expected"), [(8 * 2 * BS, [1, 2, 3, 4, 5]), (8 * 2 * BS + 3, [1, 2, 3, 4, 5])])
def test_protected_pairs_are_sinks_recent_and_partial(num_tokens, expected):
    kv = KVManager(sum_pool(num_units=12), BS, num_host_slots=16, sink_pairs=1, recent_pairs=2)
    seq = filled(kv, make_seq("a", num_tokens))
    assert kv.demotable_pairs(seq) == expected
    assert kv.num_demotable_pairs(seq) == len(expected)
    kv.release_demoted([kv.demote(seq, 2)])  # a BASE pair in the middle is no longer demotable
    assert kv.demotable_pairs(seq) == [p for p in expected if p != 2]
    assert kv.num_demotable_pairs(seq) == len(expected) - 1


def test_demote_lists_packed_block_for_both_and_frees_b():
    kv = KVManager(sum_pool(), BS, num_host_slots=1, sink_pairs=0, recent_pairs=0)
    seq = filled(kv, make_seq("a", 4 * BS))
    a, b = seq.block_table[0], seq.block_table[1]
    free_before = kv.pool.num_free()
    op = kv.demote(seq, 0)
    assert (op.block_a, op.block_b) == (a, b)
    assert seq.block_table[:2] == [a, a] and seq.pair_states[0] is PairState.BASE
    kv.release_demoted([op])
    assert kv.pool.num_free() == free_before + 1
    assert kv.num_free_slots == 0
    with pytest.raises(EngineError, match="host-backing slot"):
        kv.demote(seq, 1)
    assert_no_block_lost(kv, [seq])


def test_promote_reserves_then_publishes_and_frees_packed_block():
    kv = KVManager(sum_pool(), BS, num_host_slots=2, sink_pairs=0, recent_pairs=0)
    seq = filled(kv, make_seq("a", 4 * BS))
    kv.release_demoted([kv.demote(seq, 0)])
    packed = seq.block_table[0]
    op = kv.begin_promote(seq, 0)
    assert seq.pair_states[0] is PairState.PROMOTING
    assert seq.block_table[:2] == [packed, packed], "readers keep the packed block until the event completes"
    assert KVManager.pair_modes(seq) == [1, 0]
    assert_no_block_lost(kv, [seq])
    kv.finish_promote(seq, op)
    assert seq.block_table[:2] == [op.dst_a, op.dst_b] and seq.pair_states[0] is PairState.TARGET
    assert kv.num_free_slots == 2
    assert_no_block_lost(kv, [seq])
    with pytest.raises(EngineError):
        kv.finish_promote(seq, op)


def test_abort_mid_promotion_frees_everything():
    kv = KVManager(sum_pool(), BS, num_host_slots=4, sink_pairs=0, recent_pairs=0)
    seq = filled(kv, make_seq("a", 8 * BS))
    kv.release_demoted([kv.demote(seq, 0), kv.demote(seq, 1)])
    assert kv.begin_promote(seq, 1) is not None
    kv.free_sequence(seq)
    assert kv.pool.num_free() == kv.pool.num_blocks and kv.num_free_slots == 4
    assert kv.promotions_in_flight() == []


def test_a_stale_promotion_equal_to_a_new_one_is_not_published_for_it():
    """A promotion abandoned with its preempted sequence can finish its copy after the recomputed sequence promoted
    the same pair onto the same blocks from the same slot: the two ops are equal field for field. Publishing the
    stale one (value matching did) would show the new blocks before their own unpack ran, and then fail the
    engine's step, since ``finish_promote`` checks identity."""
    kv = KVManager(FlatBlockPool(3), BS, num_host_slots=1, sink_pairs=0, recent_pairs=0)  # one pair, one slot

    def promoting(seq):
        kv.release_demoted([kv.demote(filled(kv, seq), 0)])
        return kv.begin_promote(seq, 0)

    first = make_seq("a", 2 * BS)
    stale = promoting(first)
    kv.free_sequence(first)  # preempted by recompute, its promotion's copy still running
    seq = make_seq("a", 2 * BS)
    fresh = promoting(seq)
    assert fresh == stale and fresh is not stale, "the scenario needs two equal ops"
    assert kv.is_promoting(fresh) and not kv.is_promoting(stale)

    class Runner:  # the stale copy completes first (one stream, in order); the fresh one is still running
        def poll_promotions(self):
            return [stale]

    class Scheduler:
        def find(self, request_id):
            return seq

    Transitions(None, kv, Scheduler(), Runner(), EventLog(), None, None, {}, 0).publish_promotions(step=1)
    assert seq.pair_states[0] is PairState.PROMOTING and kv.promotions_in_flight() == [fresh]
    assert_no_block_lost(kv, [seq])


def test_pair_modes_choose_the_attention_path_and_exposure():
    from elastiserve.kernels.attention_plan import GENERAL, NATIVE, STRUCTURED_READ_PATH, choose_path

    kv = KVManager(sum_pool(num_units=12), BS, num_host_slots=8, sink_pairs=1, recent_pairs=1)
    seq = filled(kv, make_seq("a", 6 * 2 * BS))
    assert choose_path([KVManager.pair_modes(seq)]) == (NATIVE, [])
    ops = [kv.demote(seq, 1), kv.demote(seq, 2)]
    kv.release_demoted(ops)
    assert choose_path([KVManager.pair_modes(seq)]) == (STRUCTURED_READ_PATH, [(1, 3)])
    assert kv.base_bounds(seq) == (1, 3)
    kv.record_exposure(seq, seq.num_tokens)
    assert kv.exposure.ratio == pytest.approx(2 / 6)
    kv.release_demoted([kv.demote(seq, 4)])
    assert choose_path([KVManager.pair_modes(seq)])[0] == GENERAL  # two BASE runs
    assert kv.base_bounds(seq) is None


def test_random_transitions_never_lose_a_block():
    rng = random.Random(7)
    kv = KVManager(sum_pool(num_units=16, blocks_per_unit=3), BS, num_host_slots=6, sink_pairs=1, recent_pairs=1)
    live: list[Sequence] = []
    for step in range(300):
        action = rng.choice(["add", "grow", "demote", "promote", "finish", "free"])
        if action == "add":
            seq = make_seq(f"r{step}", rng.randint(1, 6 * BS), arrival=step)
            if kv.allocate(seq, seq.num_tokens):
                seq.num_computed_tokens = seq.num_tokens
                live.append(seq)
        elif action == "grow" and live:
            seq = rng.choice(live)
            if kv.allocate(seq, 1):
                seq.token_ids.append(0)
                seq.num_computed_tokens += 1
        elif action == "demote":
            cands = [(s, p) for s in live for p in kv.demotable_pairs(s)]
            if cands and kv.num_free_slots:
                kv.release_demoted([kv.demote(*rng.choice(cands))])
        elif action == "promote":
            cands = list(kv.promotion_candidates(live))
            if cands:
                kv.begin_promote(*rng.choice(cands))
        elif action == "finish":
            for op in kv.promotions_in_flight():
                kv.finish_promote(next(s for s in live if s.request_id == op.request_id), op)
        elif action == "free" and live:
            kv.free_sequence(live.pop(rng.randrange(len(live))))
        assert_no_block_lost(kv, live)
        assert kv.num_free_slots + kv.counts()["base_pairs"] + kv.counts()["promoting_pairs"] == 6
        kv.pool.state.check_invariants()
    for seq in live:
        kv.free_sequence(seq)
    assert kv.pool.num_free() == kv.pool.num_blocks and kv.num_free_slots == 6


def test_lazy_candidates_rank_and_count_like_the_full_lists():
    """The engine ranks lazily merged per-sequence streams and counts promotable pairs without building them; both
    must give what the full lists give, whatever the mix of TARGET / BASE / PROMOTING pairs."""
    from elastiserve.control.observation import PairInfo, rank_demotable, rank_demotable_streams

    rng = random.Random(3)
    kv = KVManager(sum_pool(num_units=128, blocks_per_unit=3), BS, num_host_slots=40, sink_pairs=1, recent_pairs=1)
    live = [filled(kv, make_seq(f"r{i}", rng.randint(1, 12 * 2 * BS), arrival=rng.random())) for i in range(12)]
    for _ in range(15):
        cands = [(s, p) for s in live for p in kv.demotable_pairs(s)]
        if cands and kv.num_free_slots:
            kv.release_demoted([kv.demote(*rng.choice(cands))])
    for seq, pair in list(kv.promotion_candidates(live))[:3]:
        kv.begin_promote(seq, pair)
    assert sum(kv.num_demotable_pairs(s) for s in live) > 8
    assert kv.num_promotable_pairs(live) == len(list(kv.promotion_candidates(live))) > 0
    base = [(s, p) for s in sorted(live, key=lambda s: s.arrival_time) for p, st in enumerate(s.pair_states)
            if st is PairState.BASE]
    assert list(kv.promotion_candidates(live)) == base
    for seq in live:
        end = kv.num_complete_pairs(seq) - kv.recent_pairs
        walk = [p for p in range(kv.sink_pairs, end) if seq.pair_states[p] is PairState.TARGET]
        assert kv.demotable_pairs(seq) == walk
        assert [p for p in range(len(seq.pair_states)) if kv.is_demotable(seq, p)] == walk
    full = [PairInfo(i, p, 0, "decoding") for i, s in enumerate(live) for p in kv.demotable_pairs(s)]
    streams = [kv.demotion_stream(s, i) for i, s in enumerate(live)]
    assert rank_demotable_streams(streams, 8) == rank_demotable(full, 8)


def test_base_tokens_counts_like_a_walk_over_every_pair():
    """``base_tokens`` counts whole pairs in C and walks only the pairs that reach past ``seq_len``; it must equal
    the per-pair sum for any layout of TARGET / BASE / PROMOTING pairs and any length."""
    rng = random.Random(11)
    kv = KVManager(sum_pool(), BS, num_host_slots=0)
    pair_tokens = 2 * BS
    for _ in range(300):
        seq = make_seq("s", 1)
        seq.pair_states = PairStates(rng.choice(list(PairState)) for _ in range(rng.randint(0, 12)))
        seq_len = rng.randint(0, (len(seq.pair_states) + 2) * pair_tokens)
        walk = sum(max(0, min(seq_len, (p + 1) * pair_tokens) - p * pair_tokens)
                   for p, state in enumerate(seq.pair_states) if state is not PairState.TARGET)
        assert kv.base_tokens(seq, seq_len) == walk
        assert KVManager.pair_modes(seq) == ([] if walk == 0 and all(s is PairState.TARGET for s in seq.pair_states)
                                             else [int(s is not PairState.TARGET) for s in seq.pair_states])
