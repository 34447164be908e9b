"""``PairStates`` keeps its BASE / PROMOTING counts equal to a count of the list through every in-place list
operation (the engine's per-step exposure, demotable and promotable counts read them instead of scanning), and the
KV manager's counts built on them equal walks over every pair."""

import copy
import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from list_ops import apply_list_op, list_operations

from elastiserve.engine.kv_manager import KVManager
from elastiserve.engine.pair_states import PairState, PairStates

pytestmark = [pytest.mark.cpu]

states = st.sampled_from(list(PairState))
operations = list_operations(states)


def assert_counts(pairs: PairStates) -> None:
    assert pairs.num_not_target == sum(s is not PairState.TARGET for s in pairs)
    assert pairs.num_base == sum(s is PairState.BASE for s in pairs)


@settings(max_examples=300, deadline=None)
@given(st.lists(operations, max_size=40))
def test_counts_follow_every_list_operation(ops):
    pairs = PairStates([PairState.TARGET, PairState.BASE, PairState.PROMOTING])
    plain = list(pairs)
    for op in ops:
        apply_list_op(pairs, op)
        apply_list_op(plain, op)
        assert_counts(pairs)
    assert list(pairs) == plain


def test_copies_and_pickles_count_their_own_entries():
    pairs = PairStates([PairState.BASE, PairState.TARGET, PairState.PROMOTING])
    twin = copy.copy(pairs)
    twin[0] = PairState.TARGET
    assert (pairs.num_not_target, pairs.num_base) == (2, 1) and (twin.num_not_target, twin.num_base) == (1, 0)
    for again in (pickle.loads(pickle.dumps(pairs)), copy.deepcopy(pairs)):
        assert isinstance(again, PairStates) and again == pairs
        assert (again.num_not_target, again.num_base) == (2, 1)


def test_demotable_and_promotable_counts_equal_walks_over_every_pair():
    """``num_demotable_pairs`` counts TARGET pairs in [sink, end) from the list's own counts less the few pairs
    outside that range; ``num_promotable_pairs`` the BASE ones. Both must equal a walk, for any layout and any
    protected range, including BASE pairs in the sink and past ``end`` (which demotion itself never makes)."""
    from elastiserve.engine.sampling import SamplingParams
    from elastiserve.engine.sequence import Sequence, SequenceMetrics

    rng = random.Random(5)
    block = 4
    for _ in range(400):
        sink, recent = rng.randint(0, 2), rng.randint(0, 2)
        kv = KVManager.__new__(KVManager)  # only the range and the sequence are read
        kv.sink_pairs, kv.recent_pairs, kv.block_size = sink, recent, block
        n = rng.randint(0, 14)
        seq = Sequence("s", [0], 1, SamplingParams(), SequenceMetrics(0.0))
        seq.pair_states = PairStates(rng.choice(list(PairState)) for _ in range(n))
        seq.block_table.extend(range(2 * n))
        seq.num_computed_tokens = rng.randint(0, 2 * block * n)
        end = kv.num_complete_pairs(seq) - recent
        walk = sum(1 for p in range(sink, end) if seq.pair_states[p] is PairState.TARGET)
        assert kv.num_demotable_pairs(seq) == walk
        assert KVManager.num_promotable_pairs([seq, seq]) == 2 * seq.pair_states.count(PairState.BASE)
