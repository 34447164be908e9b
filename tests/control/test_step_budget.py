"""The step-time token budget (``elastiserve.control.step_budget``): a least-squares fit per precision mode of
recent chunk-carrying steps, the cap it implies (with the largest residual as margin, clamped to the budget and a
floor), no cap before enough samples unless primed, steps of one size capped at their slowest rate, a new mode
borrowing the smallest learned budget; and the simulator's replicas keeping their steps under the bound with it."""

from __future__ import annotations

import pytest

from elastiserve.control.config import preset
from elastiserve.control.sim_replica import ReplicaConfig
from elastiserve.control.simulator import SimConfig, simulate
from elastiserve.control.step_budget import StepBudget, StepBudgetConfig
from elastiserve.control.step_model import load_step_model
from elastiserve.control.workloads import load_trace
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]


def budget(bound=0.1, max_tokens=2048, **kw) -> StepBudget:
    return StepBudget(StepBudgetConfig(bound, max_tokens, **kw))


def test_exact_line_gives_the_hand_computed_cap():
    b = budget(min_samples=4)
    for tokens in (256, 512, 1024, 2048):  # 20 ms + 50 us per token
        b.record(0, tokens, 0.020 + 5e-5 * tokens)
    fit = b.fit(0)
    assert fit.intercept_s == pytest.approx(0.020) and fit.per_token_s == pytest.approx(5e-5)
    assert fit.margin_s == pytest.approx(0.0, abs=1e-12)
    assert b.tokens(0) == 1600  # (0.1 - 0.02) / 5e-5, within float rounding of the floor
    assert b.tokens(40) == 1600  # a mode not learned yet borrows the learned one's budget


def test_margin_is_the_largest_residual():
    b = budget(min_samples=10, window=10)
    noise = [0, 0, 0, 0, 0, 0, 0, 0, 0.004, -0.004]  # one step 4 ms slow, one 4 ms fast: the line stays
    for i, extra in enumerate(noise):
        b.record(0, 200 * (i + 1), 0.020 + 5e-5 * 200 * (i + 1) + extra)
    fit = b.fit(0)
    residuals = sorted(y - (fit.intercept_s + fit.per_token_s * x)
                       for x, y in [(200 * (i + 1), 0.020 + 1e-2 * (i + 1) + e) for i, e in enumerate(noise)])
    assert fit.margin_s == pytest.approx(residuals[-1]) and fit.margin_s > 0.003
    assert b.tokens(0) == int((0.1 - fit.intercept_s - fit.margin_s) / fit.per_token_s)


def test_no_cap_without_enough_samples_spread_or_slope():
    b = budget(min_samples=3)
    b.record(0, 1000, 0.2)
    b.record(0, 2000, 0.3)
    assert b.tokens(0) == 2048  # two samples
    for _ in range(2):
        b.record(1, 1000, 0.5)
    assert b.tokens(1) == 2048  # too few samples of a new mode, nothing learned elsewhere to borrow
    b.record(2, 500, 0.3), b.record(2, 1000, 0.2), b.record(2, 1500, 0.1)
    assert b.tokens(2) == 2048  # steps that got faster with more tokens: nothing to learn


def test_steps_of_one_size_cap_at_the_slowest_rate_and_never_lock_to_a_borrowed_floor():
    """Session 11's lock on the H200: a cold first step held the full-mode fit at the floor, fast mode borrowed it,
    every step then carried the floor's tokens, and without spread fast mode never learned its own budget."""
    b = budget(bound=0.11, min_samples=8, min_tokens=256)
    b.record(0, 374, 0.2863)
    for _ in range(7):
        b.record(0, 256, 0.040)
    full = b.tokens(0)
    assert full < 300 and b.tokens(48) == full  # the outlier holds full mode near the floor; fast borrows it
    for seconds in (0.027, 0.028, 0.0285, 0.026, 0.027, 0.027, 0.025, 0.026):
        b.record(48, 256, seconds)
    assert b.tokens(48) == 988  # floor(0.11 / (0.0285 / 256)): no intercept, the slowest step's rate
    b.record(48, 988, 0.020 + 988 * 0.03 / 1000)  # the larger step gives spread: the fit takes over
    assert b.fit(48) is not None and b.tokens(48) > 988


def test_a_switch_to_a_slower_mode_waits_for_a_step_planned_for_it():
    """A step scheduled at fast mode's budget keeps fast mode when going full would put it over full mode's
    budget; the next step is planned at the smaller budget. Going into FP8 never waits."""
    b = budget(bound=0.1, min_samples=2)
    for tokens in (500, 1000):
        b.record(0, tokens, 0.020 + 1e-4 * tokens)  # full: (0.1 - 0.02) / 1e-4 = 800 tokens
        b.record(48, tokens, 0.020 + 4e-5 * tokens)  # fast: 2,000 tokens, the budget's maximum 2,048 above it
    full, fast = b.tokens(0), b.tokens(48)
    assert 799 <= full <= 800 and 1999 <= fast <= 2000
    assert b.defers(48, 0, fast) and b.defers(48, 0, full + 1) and not b.defers(48, 0, full)
    assert not b.defers(0, 48, 2048) and not b.defers(48, 48, 2048)
    assert b.plan_tokens(48, None) == fast and b.plan_tokens(48, 0) == full and b.plan_tokens(0, 48) == full


# Full mode's first chunk-carrying steps of dps at 14 req/s on the H200 (session 12, call 2): (tokens, seconds).
COLD_FIRST_STEP = (374, 0.2358)
H200_FULL_STEPS = [(1839, 0.0962), (2048, 0.1036), (2048, 0.1007), (2048, 0.1051), (761, 0.0601), (1125, 0.0816),
                   (1750, 0.0977), (410, 0.0533), (2048, 0.1090)]


def test_a_cold_first_step_is_left_out_and_the_budget_caps():
    """With the 236 ms first step in the fit the slope is negative and nothing is capped; once one more step than
    min_samples is kept, the fit leaves that step out and caps like the steps without it."""
    with_cold, without = budget(bound=0.11), budget(bound=0.11)
    with_cold.record(0, *COLD_FIRST_STEP)
    for step in H200_FULL_STEPS:
        with_cold.record(0, *step)
        without.record(0, *step)
    assert with_cold.fit(0) is not None and with_cold.fit(0).samples == len(H200_FULL_STEPS)
    assert with_cold.tokens(0) == without.tokens(0) == 2025
    fit = without.fit(0)
    assert fit.margin_s == pytest.approx(0.00575, abs=1e-5)  # the spread of ordinary steps stays in the margin
    truncated = budget(bound=0.11)  # exactly min_samples kept: nothing is left out, and nothing is capped
    for step in [COLD_FIRST_STEP, *H200_FULL_STEPS[:7]]:
        truncated.record(0, *step)
    assert truncated.fit(0) is None and truncated.tokens(0) == 2048


def test_steps_that_are_slow_more_than_once_stay_in_the_fit():
    """Two such steps are no one-off: neither is left out, so the slope stays negative and nothing is capped (the
    rule drops one step at most, and only one far from every other)."""
    b = budget(bound=0.11)
    for step in [COLD_FIRST_STEP, COLD_FIRST_STEP, *H200_FULL_STEPS]:
        b.record(0, *step)
    assert b.fit(0) is None and b.tokens(0) == 2048


def test_cap_is_clamped_to_floor_and_budget():
    slow = budget(min_samples=2, min_tokens=256)
    slow.record(0, 100, 0.5), slow.record(0, 200, 0.6)  # already over the bound: the floor
    assert slow.tokens(0) == 256
    fast = budget(min_samples=2)
    fast.record(0, 100, 0.001), fast.record(0, 200, 0.002)
    assert fast.tokens(0) == 2048


def test_window_forgets_old_steps():
    b = budget(min_samples=2, window=2)
    b.record(0, 100, 0.5), b.record(0, 200, 0.6)
    b.record(0, 1000, 0.02 + 5e-5 * 1000), b.record(0, 2000, 0.02 + 5e-5 * 2000)
    assert b.tokens(0) == 1600


@pytest.mark.parametrize("kw", [dict(max_step_time_s=0.0), dict(max_step_time_s=-1.0), dict(min_samples=1),
                                dict(window=4, min_samples=8), dict(min_tokens=0)])
def test_bad_config_is_a_typed_error(kw):
    args = dict(max_step_time_s=0.1, max_tokens=2048) | kw
    with pytest.raises(ConfigError):
        StepBudgetConfig(**args)
    if "max_step_time_s" in kw:
        with pytest.raises(ConfigError, match="max_step_time_s"):
            ReplicaConfig(max_step_time_s=kw["max_step_time_s"])


def test_an_unlearned_mode_borrows_the_smallest_learned_budget():
    b = budget(min_samples=2)
    assert b.tokens(5) == 2048  # nothing learned anywhere: no cap
    for tokens in (500, 1000):
        b.record(0, tokens, 0.020 + 5e-5 * tokens)  # full: 1,600
        b.record(32, tokens, 0.010 + 2.5e-5 * tokens)  # fast: 3,600 -> 2,048
    full = b.tokens(0)
    assert full in (1599, 1600) and b.tokens(32) == 2048 and b.tokens(7) == full  # 1,600 within float rounding


class RecordingStepModel:
    """The shipped step model, keeping (tokens, seconds) of every step with a prefill chunk."""

    def __init__(self):
        self.model, self.steps = load_step_model(), []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def step_time(self, tokens, *args, padded_rows=0, **kw):
        dt = self.model.step_time(tokens, *args, padded_rows=padded_rows, **kw)
        if padded_rows == 0:  # a step with a prefill chunk (decode-only steps replay padded graphs)
            self.steps.append((tokens, dt))
        return dt


def chunk_steps(requests, cap):
    sim = SimConfig(replica=ReplicaConfig(native_blocks=4096, units_per_layer=32, max_num_seqs=128,
                                          max_num_batched_tokens=8192, max_step_time_s=cap))
    model = RecordingStepModel()
    result = simulate(requests, "combined", sim, model)
    assert all(r.finished for r in result.records)
    return model.steps


def test_simulated_steps_stay_under_the_bound_from_the_first():
    """The simulator's replica with the same budget: at 8,192-token chunks its chunk-carrying steps take over 100
    ms; capped at 30 ms and primed as the engine primes its budget (the step model times the probe's eight steps,
    a quarter to all of the chunk in both whole-model modes), the served steps stay under it from the first, but
    for the odd step costlier than any in the fit's window (1 of 308, by 1.7 %: a step's context and demotion terms
    are not in the line)."""
    requests = load_trace("azure-window", 0, 300, time_scale=0.2)
    seen = {cap: chunk_steps(requests, cap) for cap in (None, 0.03)}
    assert max(dt for _, dt in seen[None]) > 0.1
    probe, served = seen[0.03][:8], seen[0.03][8:]
    assert [t for t, _ in probe] == [2048, 4096, 6144, 8192] * 2  # full mode's, then fast mode's
    over = [dt for _, dt in served if dt > 0.03]
    assert served and len(over) <= 0.01 * len(served) and max(dt for _, dt in served) <= 0.0306
    assert max(t for t, _ in served) < 8192 and max(t for t, _ in served) > 256


def test_the_bound_restores_joint_slo_attainment_at_large_chunks():
    """Azure window 5x faster, the engine's admission settings: at 8,192-token chunks combined's steps with a chunk
    break the joint SLO's TBT bound (5 x T_base = 26.3 ms with the shipped step model) for nearly every request;
    with the steps kept under 22 ms it meets the SLO again, as it does at 512-token chunks."""
    requests = load_trace("azure-window", 0, 1200, time_scale=0.2)
    control = preset("combined").with_engine_admission()
    attainment = {}
    for cap in (None, 0.022):
        sim = SimConfig(replica=ReplicaConfig(native_blocks=4096, units_per_layer=32, max_num_seqs=128,
                                              max_num_batched_tokens=8192, max_step_time_s=cap))
        attainment[cap] = simulate(requests, control, sim).summary().attainment
    assert attainment[None] < 0.1 and attainment[0.022] > 0.99


def test_primed_steps_cap_before_any_served_step_and_give_way_to_served_ones():
    """Steps timed before serving stand in for a mode's first ``min_samples`` served steps: they cap from the first
    step, a served step above their line raises the margin at once, and ``min_samples`` served steps replace them."""
    primed_line = [(tokens, 0.020 + 5e-5 * tokens) for tokens in (512, 1024, 1536, 2048)]  # 20 ms + 50 us/token

    b = budget(min_samples=4)
    b.prime(0, primed_line)
    assert b.tokens(0) == 1600  # (0.1 - 0.02) / 5e-5, as test_exact_line_gives_the_hand_computed_cap
    assert b.tokens(48) == 1600  # an unprimed mode borrows the primed one's budget
    b.record(0, 1000, 0.075)  # served: 5 ms above the primed line (70 ms)
    fit = b.fit(0)
    assert fit.samples == 5 and fit.margin_s > 0.003 and b.tokens(0) < 1600

    b = budget(min_samples=4)
    b.prime(0, primed_line)
    for tokens in (800, 1000, 1200, 1600):  # served steps on another line: 30 ms + 40 us per token
        b.record(0, tokens, 0.030 + 4e-5 * tokens)
    fit = b.fit(0)
    assert fit.samples == 4 and fit.intercept_s == pytest.approx(0.030) and fit.per_token_s == pytest.approx(4e-5)
    assert b.tokens(0) == 1750  # (0.1 - 0.03) / 4e-5: the primed steps no longer count


def test_priming_refuses_steps_that_cannot_be_timed():
    with pytest.raises(ConfigError, match="prime"):
        budget().prime(0, [(0, 0.01)])
    with pytest.raises(ConfigError, match="prime"):
        budget().prime(0, [(512, 0.0)])


def test_primed_steps_stay_while_the_served_ones_give_no_line():
    """The H200's full mode in session 14: a cold first step and seven of one size have no positive slope; the primed
    steps keep capping (fitted with the served ones) instead of the mode borrowing a faster mode's budget."""
    b = budget(bound=0.11, max_tokens=3072, min_samples=8)
    b.prime(0, [(tokens, 0.010 + 4.5e-5 * tokens) for tokens in (768, 1536, 2304, 3072) for _ in range(2)])
    b.prime(48, [(tokens, 0.008 + 3.0e-5 * tokens) for tokens in (768, 1536, 2304, 3072) for _ in range(2)])
    assert b.tokens(48) == 3072
    b.record(0, 374, 0.270)
    for _ in range(7):
        b.record(0, 1932, 0.103)
    fit = b.fit(0)
    assert fit is not None and fit.samples == 15  # the cold step is a one-off, left out
    assert fit.per_token_s == pytest.approx(4.5e-5, rel=0.01) and fit.margin_s > 0.003  # served above the priors
    assert b.tokens(0) == 2087  # (0.11 - 0.01274 - 0.00323) / 4.505e-5, not fast mode's 3,072
    for tokens in (1000, 1200, 1400, 1600, 1800, 1900, 1950, 2000):  # served steps with spread replace the priors
        b.record(0, tokens, 0.040 + 3.5e-5 * tokens)
    assert b.fit(0).samples == 15  # the 16 served less the cold one: the priors no longer count
