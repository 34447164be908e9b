"""Pins the arbiter: each preset uses only its mechanisms, the cost order (cheap residual layers, then demotion,
then preemption only for running work), recovery in reverse cost order, and no flapping under steady load."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastiserve.control.arbiter import Arbiter
from elastiserve.control.config import preset
from elastiserve.control.observation import ALL_LAYERS, StepObservation

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def obs(free=10, demand=40, required=30, evicted=(), base=0, eligible=100, **kw):
    evicted = frozenset(evicted)
    return StepObservation(step=kw.pop("step", 0), now=kw.pop("now", 0.0), free_blocks=free,
                           total_blocks=1000 + 20 * len(evicted), native_blocks=1000, demand_blocks=demand,
                           required_blocks=required, blocks_per_unit=1, residual_layers=4, units_per_layer=20,
                           backed_units=20 * (4 - len(evicted)), evicted_layers=evicted, fast_layers=evicted,
                           target_pairs_eligible=eligible, base_pairs=base, resident_pairs=400,
                           base_pairs_promotable=base, **kw)


def test_each_preset_uses_only_its_mechanisms():
    o = obs()  # shortage 30, running work short by 20
    fp16 = Arbiter(preset("static-fp16"), 128).decide_pressure(o)
    assert (fp16.demote_pairs, fp16.evict_residual_layers, fp16.preempt) == (0, (), 20)
    fp8 = Arbiter(preset("static-fp8"), 128).decide_pressure(o)
    assert fp8.evict_residual_layers == ALL_LAYERS and fp8.preempt == 0 and fp8.demote_pairs == 0
    dps = Arbiter(preset("dps"), 128).decide_pressure(o)
    assert dps.evict_residual_layers == ALL_LAYERS and dps.demote_pairs == 0 and dps.preempt == 0
    ekv = Arbiter(preset("elastickv"), 128).decide_pressure(o)
    assert ekv.demote_pairs == 30 and ekv.evict_residual_layers == () and ekv.preempt == 0
    comb = Arbiter(preset("combined"), 128).decide_pressure(o)
    # 30 blocks need 2 layers of 20; the preset's min_evict_layers = 4 takes all four this test model has.
    assert comb.evict_residual_layers == (0, 1, 2, 3) and comb.demote_pairs == 0
    exact = replace(preset("combined"), precision=replace(preset("combined").precision, min_evict_layers=1))
    assert Arbiter(exact, 128).decide_pressure(o).evict_residual_layers == (0, 1)


def test_combined_demotes_after_residuals_run_out_and_preempts_last():
    arb = Arbiter(preset("combined"), 128)
    d = arb.decide_pressure(obs(free=0, demand=50, required=50, evicted=range(4), eligible=30))
    assert d.evict_residual_layers == () and d.demote_pairs == 30 and d.preempt == 20


def test_elastickv_preempts_only_what_demotion_cannot_cover_for_running_work():
    d = Arbiter(preset("elastickv"), 128).decide_pressure(obs(free=0, demand=50, required=20, eligible=5))
    assert d.demote_pairs == 5 and d.preempt == 15


def test_recovery_reverse_cost_order():
    arb = Arbiter(preset("combined"), 128)
    arb.decide_pressure(obs(free=900, demand=0))
    o = obs(free=900, demand=None, evicted=(3,), base=10, restorable_layers=(3,), free_units=900)
    d = arb.decide_recovery(o)
    # Demotion costs more per block than a residual layer: promote first, restore on a later step.
    assert d.promote_pairs == 10 and not d.start_restore
    arb.decide_pressure(obs(free=900, demand=0))
    calm_too_short = obs(free=900, demand=None, evicted=(3,), restorable_layers=(3,), free_units=900, now=4.0)
    assert not arb.decide_recovery(calm_too_short).start_restore  # calm since t=0, dwell is 5 s
    arb.decide_pressure(obs(free=900, demand=0))
    d = arb.decide_recovery(obs(free=900, demand=None, evicted=(3,), restorable_layers=(3,), free_units=900, now=5.0))
    assert d.start_restore and d.restore_layers == (3,) and d.promote_pairs == 0


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["static-fp16", "static-fp8", "dps", "elastickv", "combined"]),
       st.integers(0, 300), st.integers(0, 300), st.integers(0, 200))
def test_steady_load_causes_no_flapping(name, free, demand, base):
    """The same observation, step after step (decisions not applied, F_post consistent with the step): never a
    demotion and a promotion, or an eviction and a restore, in one step."""
    arb = Arbiter(preset(name), 128)
    for step in range(30):
        o = obs(free=free, demand=demand, required=min(demand, 10), base=base, step=step, now=step * 0.01,
                restorable_layers=(), free_units=free)
        p = arb.decide_pressure(o)
        # F_post as the scheduler would leave it: what demotion freed, minus this step's demand.
        f_post = max(0, free + p.demote_pairs - demand)
        r = arb.decide_recovery(obs(free=f_post, demand=None, base=base, step=step, now=step * 0.01,
                                    free_units=f_post))
        assert not (p.demote_pairs and r.promote_pairs)
        assert not (p.evict_residual_layers and r.start_restore)
