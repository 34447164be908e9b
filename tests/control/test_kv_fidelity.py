"""Pins ElasticKV Algorithm 1 against hand-computed steps (shortage, B_min batching, surplus, decaying reserve,
promotion budget with 2 blocks per pair in flight, capacity guard) and the three ablation variants; hypothesis checks
that the reserve is never negative and promotion never eats it."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastiserve.control.config import KVFidelityConfig
from elastiserve.control.kv_fidelity import (
    KVFidelityPolicy,
    capacity_guard,
    demotion_count,
    next_reserve,
    promotion_budget,
    surplus,
)

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def test_formulas_by_hand():
    assert capacity_guard(38, 2048, 16) == 128  # max(38, ceil(2048/16))
    assert capacity_guard(256, 2048, 16) == 256
    assert capacity_guard(4, 100, 16) == 7  # ceil(100/16)
    assert demotion_count(0, 100, 16) == 0
    assert demotion_count(2, 100, 16) == 16  # at least B_min once triggered
    assert demotion_count(20, 100, 16) == 20
    assert demotion_count(20, 5, 16) == 5  # capped by eligible pairs
    assert surplus(16, 2) == 14 and surplus(5, 20) == 0
    assert next_reserve(5, 2, 14) == 17 and next_reserve(1, 2, 0) == 0
    assert promotion_budget(30, 17) == 13 and promotion_budget(10, 17) == 0


def test_three_steps_of_algorithm_1():
    policy = KVFidelityPolicy(KVFidelityConfig(), a_max=128)
    # t=1: F=10, D=12 -> shortage 2, demote max(2, 16) = 16, E = 14; F_post = 10 + 16 - 12 = 14.
    n = policy.plan_demotion(free_blocks=10, shortage=2, eligible=50, base_pairs=0, resident_pairs=60)
    assert n == 16
    policy.record_demotion(n, 2)
    # R_1 = max(0, 0 - 2) + 14 = 14; P_1 = max(0, 14 - 14) = 0 -> no promotion.
    assert policy.plan_promotion(14, promotable=16, in_flight=0, transfer_slack=True) == 0
    assert policy.reserve == 14
    # t=2: no shortage; R_2 = 12; F_post = 20 -> P = 8 blocks -> 4 pairs.
    policy.record_demotion(0, 0)
    assert policy.plan_promotion(20, promotable=16, in_flight=0, transfer_slack=True) == 4
    assert policy.reserve == 12
    # t=3: R_3 = 10; F_post = 21 -> P = 11 -> 5 pairs, but no transfer slack -> 0.
    assert policy.plan_promotion(21, promotable=16, in_flight=0, transfer_slack=False) == 0
    assert policy.reserve == 10


def test_capacity_guard_skips_probe():
    policy = KVFidelityPolicy(KVFidelityConfig(), a_max=128)
    assert policy.should_probe(128) and not policy.should_probe(129)


def test_ablation_variants():
    water = KVFidelityPolicy(KVFidelityConfig(demotion_trigger="watermark", watermark=40), a_max=8)
    # No shortage, but F = 30 < watermark 40: demote max(10, B_min) = 16.
    assert water.plan_demotion(30, 0, 100, 0, 200) == 16
    assert water.plan_demotion(50, 0, 100, 0, 200) == 0
    eager = KVFidelityPolicy(KVFidelityConfig(promotion="eager"), a_max=8)
    eager.record_demotion(16, 2)
    assert eager.plan_promotion(14, 100, 0, True) == 7  # reserve 14 ignored: 14 // 2
    none = KVFidelityPolicy(KVFidelityConfig(promotion="none"), a_max=8)
    assert none.plan_promotion(1000, 100, 0, True) == 0


def test_caps():
    policy = KVFidelityPolicy(KVFidelityConfig(max_base_fraction=0.25, max_promotions_in_flight=3), a_max=8)
    assert policy.plan_demotion(0, 40, 100, base_pairs=20, resident_pairs=100) == 5  # floor(25) - 20
    assert policy.plan_promotion(100, 50, in_flight=1, transfer_slack=True) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 80), st.integers(0, 60), st.integers(0, 120), st.integers(0, 40)),
                min_size=1, max_size=40),
       st.sampled_from(["reserve", "eager", "none"]))
def test_reserve_never_negative_and_never_eaten(steps, promotion):
    policy = KVFidelityPolicy(KVFidelityConfig(promotion=promotion), a_max=64)
    for free, shortage, eligible, f_post in steps:
        n = policy.plan_demotion(free, shortage, eligible, 0, eligible)
        assert 0 <= n <= eligible
        assert n == 0 or n >= min(eligible, shortage)
        policy.record_demotion(n, shortage)
        pairs = policy.plan_promotion(f_post, promotable=1000, in_flight=0, transfer_slack=True)
        assert policy.reserve >= 0
        protected = policy.reserve if promotion == "reserve" else 0
        assert 2 * pairs <= max(0, f_post - protected)
        if promotion == "none":
            assert pairs == 0
