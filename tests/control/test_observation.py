"""Pins the observation/decision types and the pair ranking: sinks, recent pairs and pairs without backing are never
demoted; non-urgent requests and least recently used pairs go first; the lazy per-sequence merge used by the
simulator ranks exactly like ``rank_demotable``."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastiserve.control.observation import Decision, PairInfo, StepObservation, rank_demotable, rank_demotable_streams
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def test_rank_demotable_by_hand():
    pairs = [
        PairInfo(1, 0, 5, "decoding", is_sink=True),
        PairInfo(1, 1, 5, "decoding"),
        PairInfo(1, 2, 5, "decoding", is_recent=True),
        PairInfo(2, 1, 3, "decoding"),
        PairInfo(3, 4, 9, "waiting"),
        PairInfo(4, 1, 1, "decoding", has_backing=False),
        PairInfo(5, 2, 5, "prefilling"),
    ]
    ranked = [(p.seq_id, p.pair_index) for p in rank_demotable(pairs, 10)]
    assert ranked == [(3, 4), (5, 2), (2, 1), (1, 1)]
    assert rank_demotable(pairs, 0) == []
    assert [(p.seq_id, p.pair_index) for p in rank_demotable(pairs, 2)] == [(3, 4), (5, 2)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["decoding", "waiting", "prefilling", "finishing"]),
                          st.integers(0, 12), st.booleans()), min_size=0, max_size=8),
       st.integers(0, 30))
def test_lazy_merge_matches_full_ranking(seqs, n):
    streams = []
    for seq_id, (last_used, status, count, sink) in enumerate(seqs):
        streams.append([PairInfo(seq_id, p, last_used, status, is_sink=sink and p == 0) for p in range(count)])
    flat = [p for s in streams for p in s]
    assert rank_demotable_streams([iter(s) for s in streams], n) == rank_demotable(flat, n)


def test_observation_derived_numbers_and_validation():
    o = StepObservation(step=3, now=1.0, free_blocks=20, total_blocks=120, native_blocks=100, demand_blocks=35,
                        required_blocks=25, blocks_per_unit=4, units_per_layer=5)
    assert (o.used_blocks, o.occupancy, o.shortage, o.required_shortage, o.blocks_per_layer) == (100, 1.0, 15, 5, 20)
    skipped = StepObservation(step=3, now=1.0, free_blocks=20, total_blocks=120, native_blocks=100, demand_blocks=None)
    assert skipped.shortage == 0
    with pytest.raises(ConfigError):
        StepObservation(step=0, now=0.0, free_blocks=200, total_blocks=100, native_blocks=100, demand_blocks=None)


def test_decision_rejects_contradictions():
    assert Decision().is_noop
    with pytest.raises(ConfigError):
        Decision(demote_pairs=1, promote_pairs=1)
    with pytest.raises(ConfigError):
        Decision(evict_residual_layers="all", start_restore=True)
    with pytest.raises(ConfigError):
        Decision(preempt=-1)
