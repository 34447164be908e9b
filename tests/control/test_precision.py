"""Pins the DPS precision policy: fast on shortage or occupancy above kappa_high, restore one layer at a time only
below kappa_low with the layer's units FREE and spare free units, per-layer k = ceil(shortage_units/units_per_layer)
where layers are alike, and the fewest lowest layers whose own units cover the shortage where they are not."""

import pytest

from elastiserve.control.config import PrecisionConfig
from elastiserve.control.observation import ALL_LAYERS, StepObservation
from elastiserve.control.precision import (
    PrecisionPolicy,
    QueuePressure,
    group_prefixes,
    layers_covering,
    layers_to_run_fast,
)
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def obs(free, total=1000, native=1000, evicted=(), restorable=(), free_units=0, demand=None, residual_layers=4, **kw):
    return StepObservation(step=0, now=0.0, free_blocks=free, total_blocks=total, native_blocks=native,
                           demand_blocks=demand, blocks_per_unit=2, residual_layers=residual_layers, units_per_layer=10,
                           evicted_layers=frozenset(evicted), fast_layers=frozenset(evicted),
                           restorable_layers=tuple(restorable), free_units=free_units, **kw)


def test_layers_covering_by_hand():
    alike = [10] * 4
    assert layers_covering(0, 2, alike) == 0
    assert layers_covering(1, 2, alike) == 1  # 1 unit -> 1 layer
    assert layers_covering(20, 2, alike) == 1  # 10 units -> exactly one layer
    assert layers_covering(21, 2, alike) == 2  # 11 units -> two layers
    assert layers_covering(500, 2, alike) == 4  # more than all of them: all
    assert layers_covering(5, 2, [0, 0]) == 2
    assert layers_covering(25, 2, [4, 9, 30]) == 2  # 13 units: 4 + 9
    assert layers_covering(27, 2, [4, 9, 30]) == 3  # 14 units


def test_uneven_layers_evict_free_and_restore_by_their_own_units():
    """The last layer holds a nested lm_head's lower plane too (30 units against 10): a shortage its units cover
    evicts it alone once it is the lowest resident, the freed blocks count its units, and its restore waits for 30
    free units (plus the spare), where a typical layer's 10 would have passed."""
    policy = PrecisionPolicy(PrecisionConfig(granularity="layer", restore_min_free_units=2))
    uneven = dict(layer_units=(10, 10, 10, 30))
    assert policy.plan_eviction(obs(free=500, **uneven), 61) == (0, 1, 2, 3)  # 31 units: 10 + 10 + 10 + 30
    assert policy.plan_eviction(obs(free=500, evicted=(0, 1, 2), total=1060, **uneven), 41) == (3,)
    assert policy.freed_blocks(obs(free=500, **uneven), (2, 3)) == (10 + 30) * 2
    assert policy.freed_blocks(obs(free=500, evicted=(0,), total=1020, **uneven), ALL_LAYERS) == 50 * 2
    base = dict(evicted=(3,), total=1060, restorable=(3,), **uneven)
    assert policy.plan_restore(obs(free=900, free_units=31, **base), 0) == ()
    assert policy.plan_restore(obs(free=900, free_units=32, **base), 0) == (3,)
    with pytest.raises(ConfigError, match="layer_units"):
        obs(free=500, layer_units=(10, 10))  # four residual layers


def test_model_granularity_switches_on_shortage_or_high_occupancy():
    policy = PrecisionPolicy(PrecisionConfig(kappa_low=0.5, kappa_high=0.9))
    assert policy.plan_eviction(obs(free=500), 0) == ()
    assert policy.plan_eviction(obs(free=500), 3) == ALL_LAYERS
    assert policy.plan_eviction(obs(free=50), 0) == ALL_LAYERS  # occupancy 0.95 > 0.9
    assert policy.plan_eviction(obs(free=50, evicted=range(4)), 5) == ()  # nothing left to evict


def test_layer_granularity_evicts_only_what_the_shortage_needs():
    policy = PrecisionPolicy(PrecisionConfig(granularity="layer"))
    assert policy.plan_eviction(obs(free=500), 21) == (0, 1)
    assert policy.plan_eviction(obs(free=500, evicted=(0,), total=1020), 5) == (1,)
    # Occupancy is judged against the mapped capacity, so an evicted layer does not re-trigger the next step.
    assert policy.plan_eviction(obs(free=200, evicted=(0,), total=1020), 0) == ()


def test_restore_hysteresis_and_free_units():
    policy = PrecisionPolicy(PrecisionConfig(kappa_low=0.5, kappa_high=0.9, restore_min_free_units=2))
    base = dict(evicted=(0, 1), total=1040, restorable=(1, 0))
    assert policy.plan_restore(obs(free=700, free_units=12, **base), 0) == (1,)
    assert policy.plan_restore(obs(free=400, free_units=12, **base), 0) == ()  # occupancy 0.64 >= kappa_low
    assert policy.plan_restore(obs(free=700, free_units=11, **base), 0) == ()  # would leave < 2 free units
    assert policy.plan_restore(obs(free=700, free_units=12, **base), 4) == ()  # shortage pending
    assert policy.plan_restore(obs(free=700, free_units=12, restore_in_flight=True, **base), 0) == ()
    assert policy.plan_restore(obs(free=700, free_units=12, evicted=(0, 1), total=1040), 0) == ()  # no FREE layer
    assert policy.plan_restore(obs(free=700, free_units=12, **base), 0, calm_for_s=4.9) == ()  # dwell 5 s
    assert policy.plan_restore(obs(free=700, free_units=12, **base), 0, calm_for_s=5.0) == (1,)


def test_static_fast_never_restores():
    policy = PrecisionPolicy(PrecisionConfig(static_fast=True))
    assert policy.plan_eviction(obs(free=900), 0) == ALL_LAYERS
    assert policy.plan_restore(obs(free=990, free_units=80, evicted=range(4), total=1080, restorable=(0,)), 0) == ()


def test_layer_granularity_evicts_at_least_min_layers_and_restores_the_last_evicted_first():
    policy = PrecisionPolicy(PrecisionConfig(granularity="layer", min_evict_layers=3))
    assert policy.plan_eviction(obs(free=500), 5) == (0, 1, 2)  # the shortage needs one layer; B_min is three
    assert policy.plan_eviction(obs(free=500), 61) == (0, 1, 2, 3)  # needs four: more than the minimum
    assert policy.plan_eviction(obs(free=500, evicted=(0, 1, 2), total=1060), 5) == (3,)  # only one left
    # The fast set stays a prefix: of evicted 0-2 (all restorable, listed in any order) layer 2 comes back first.
    calm = dict(free=900, free_units=40, evicted=(0, 1, 2), total=1060)
    assert policy.plan_restore(obs(restorable=(0, 1, 2), **calm), 0) == (2,)
    assert policy.plan_restore(obs(restorable=(2, 0, 1), **calm), 0) == (2,)
    assert policy.plan_restore(obs(restorable=(0, 1), **calm), 0) == (1,)  # layer 2's units still hold KV
    with pytest.raises(Exception, match="min_evict_layers"):
        PrecisionConfig(min_evict_layers=0)


def test_layer_granularity_evicts_whole_groups():
    """48 layers in 4 groups: the shortage needs one layer, B_min is 4, the group holds 12; the next shortage
    takes the following group; a partly evicted group (out-of-order restore) is completed first."""
    policy = PrecisionPolicy(PrecisionConfig(granularity="layer", min_evict_layers=4, layer_groups=4))
    many = dict(free=500, residual_layers=48)
    assert policy.plan_eviction(obs(**many), 5) == tuple(range(12))
    assert policy.plan_eviction(obs(evicted=range(12), **many), 5) == tuple(range(12, 24))
    assert policy.plan_eviction(obs(evicted=[*range(11), 12], **many), 5) == (11, *range(13, 24))


def test_layers_to_run_fast_switches_whole_model_together():
    dps = PrecisionConfig(granularity="model")
    assert layers_to_run_fast(frozenset({7}), frozenset(), 8, dps) == frozenset(range(8))  # one stale: all fast
    # restore brings layers back one by one; the model stays fast until the last one is resident
    assert layers_to_run_fast(frozenset({6, 7}), frozenset(range(8)), 8, dps) == frozenset(range(8))
    assert layers_to_run_fast(frozenset(), frozenset(range(8)), 8, dps) == frozenset()


def test_layers_to_run_fast_returns_layers_in_groups():
    per_layer = PrecisionConfig(granularity="layer", min_evict_layers=4, layer_groups=16)  # groups of one layer
    running = frozenset(range(8))
    assert layers_to_run_fast(frozenset(range(8)), frozenset(), 16, per_layer) == running  # entering is exact
    for left in range(7, 4, -1):  # 1-3 layers restored: they keep running fast
        assert layers_to_run_fast(frozenset(range(left)), running, 16, per_layer) == running
    assert layers_to_run_fast(frozenset(range(4)), running, 16, per_layer) == frozenset(range(4))  # 4 return
    assert layers_to_run_fast(frozenset({0, 9}), frozenset({0}), 16, per_layer) == frozenset({0, 9})
    assert layers_to_run_fast(frozenset(), running, 16, per_layer) == frozenset()


def test_whole_groups_run_fast_together():
    """48 layers in 4 groups of 12: a stale layer takes its whole group to fast mode; restoring part of a group
    keeps the group fast, and the last layer of a group restored brings the whole group back."""
    grouped = PrecisionConfig(granularity="layer", min_evict_layers=4, layer_groups=4)
    assert layers_to_run_fast(frozenset(range(5)), frozenset(), 48, grouped) == frozenset(range(12))
    assert layers_to_run_fast(frozenset(range(13)), frozenset(range(12)), 48, grouped) == frozenset(range(24))
    assert layers_to_run_fast(frozenset({3, 40}), frozenset(), 48, grouped) == frozenset(range(12)) | frozenset(
        range(36, 48))  # stale layers out of order: their groups, never a layer outside them
    running = frozenset(range(24))
    assert layers_to_run_fast(frozenset(range(14)), running, 48, grouped) == running  # group 1 partly restored
    assert layers_to_run_fast(frozenset(range(12)), running, 48, grouped) == frozenset(range(12))
    assert layers_to_run_fast(frozenset(), running, 48, grouped) == frozenset()
    # 50 layers in 4 groups: groups of 13, the last one short
    assert layers_to_run_fast(frozenset({49}), frozenset(), 50, grouped) == frozenset(range(39, 50))


def test_group_prefixes_are_the_mixes_captured_before_serving():
    grouped = PrecisionConfig(granularity="layer", layer_groups=4)
    assert [len(s) for s in group_prefixes(48, grouped)] == [0, 12, 24, 36, 48]
    assert [len(s) for s in group_prefixes(50, grouped)] == [0, 13, 26, 39, 50]
    assert [len(s) for s in group_prefixes(3, grouped)] == [0, 1, 2, 3]  # more groups than layers: one each
    assert group_prefixes(8, PrecisionConfig()) == [frozenset(), frozenset(range(8))]  # whole model
    with pytest.raises(Exception, match="layer_groups"):
        PrecisionConfig(layer_groups=0)


def test_queue_pressure_turns_on_at_the_threshold_and_holds_by_hand():
    """queue_fast_s = 1.0, hold 2.0: on when the oldest request without a first token has waited 1 s, still on 2 s
    after the last step that saw it, off after that; off throughout when unset or static-fp8."""
    trigger = QueuePressure(PrecisionConfig(queue_fast_s=1.0, queue_fast_hold_s=2.0))
    steps = [(0.0, 0.5), (1.0, 0.99), (2.0, 1.0), (2.5, 0.0), (4.0, 0.0), (4.01, 0.0), (5.0, 1.2), (7.5, 0.3)]
    assert [trigger.run_all_fast(now, oldest) for now, oldest in steps] == [
        False, False, True, True, True, False, True, False]  # fmt: skip
    assert not QueuePressure(PrecisionConfig()).run_all_fast(0.0, 100.0)
    assert not QueuePressure(PrecisionConfig(static_fast=True, queue_fast_s=1.0)).run_all_fast(0.0, 100.0)


def test_queued_prompts_keep_queue_pressure_on_but_never_turn_it_on():
    """queue_fast_s = 1.0, hold 2.0, with (now, oldest wait, prompts left queued by the step): on at the threshold;
    queued prompts refresh the hold while it is on (at 1.5 and 3.4 s), off 2 s after the last refresh; queued
    prompts alone, with no request over the threshold, do not turn it on."""
    trigger = QueuePressure(PrecisionConfig(queue_fast_s=1.0, queue_fast_hold_s=2.0))
    steps = [(0.0, 1.0, 0), (1.5, 0.1, 3), (3.4, 0.1, 1), (5.3, 0.0, 0), (5.5, 0.0, 0), (6.0, 0.2, 5), (9.0, 0.9, 9)]
    assert [trigger.run_all_fast(*step) for step in steps] == [True, True, True, True, False, False, False]


def test_prefill_fast_runs_exactly_the_steps_that_carry_a_prefill_chunk_and_holds_nothing():
    """prefill_fast alone: fast for each step with a prefill chunk, whatever the wait, and never the step after; with
    the queue rule too (1 s, hold 2 s) a prefill step does not refresh the hold, which still ends 2 s after the last
    step that saw a 1 s wait; static-fp8 runs fast for memory, never for this rule."""
    alone = QueuePressure(PrecisionConfig(prefill_fast=True))
    steps = [(0.0, 5.0, 3, False), (0.1, 0.0, 0, True), (0.2, 0.0, 0, False), (0.3, 0.0, 0, True)]
    assert [alone.run_all_fast(*step) for step in steps] == [False, True, False, True]
    both = QueuePressure(PrecisionConfig(queue_fast_s=1.0, queue_fast_hold_s=2.0, prefill_fast=True))
    steps = [(0.0, 0.2, 0, True), (0.5, 0.1, 0, False), (1.0, 1.0, 0, False), (2.9, 0.0, 0, True), (3.1, 0.0, 0, False),
             (3.2, 0.0, 0, True)]
    assert [both.run_all_fast(*step) for step in steps] == [True, False, True, True, False, True]
    assert not QueuePressure(PrecisionConfig(static_fast=True, prefill_fast=True)).run_all_fast(0.0, 0.0, 0, True)


def test_queue_pressure_needs_a_configuration_that_switches_precision():
    from elastiserve.control.config import preset
    from elastiserve.platforms import ConfigError

    assert preset("dps").with_precision(queue_fast_s=1.0).precision.queue_fast_s == 1.0
    assert preset("combined").with_precision(queue_fast_s=0.5).precision.granularity == "layer"
    assert preset("combined").with_precision(prefill_fast=True).precision.prefill_fast
    for name in ("static-fp16", "elastickv"):
        with pytest.raises(ConfigError, match="queue_fast_s"):
            preset(name).with_precision(queue_fast_s=1.0)
        with pytest.raises(ConfigError, match="prefill_fast"):
            preset(name).with_precision(prefill_fast=True)
    for bad in ({"queue_fast_s": 0.0}, {"queue_fast_hold_s": -1.0}):
        with pytest.raises(ConfigError):
            PrecisionConfig(**bad)
