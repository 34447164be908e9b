"""The step-time token budget (step_budget.py): a least-squares fit per precision mode of recent chunk-carrying
steps, the cap it implies (with a residual margin, clamped to the engine's budget and a floor), no cap before enough
spread-out samples; the scheduler honours the cap for chunks and admissions but never cuts decodes; and the engine,
capped, produces the same greedy tokens as uncapped in steps no longer than the cap, and learns from exactly the
steps that carry a prefill chunk."""

from __future__ import annotations

import pytest
from tiny_models import random_fp16_model, small_llama_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.kv_manager import FlatBlockPool, KVManager
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import Scheduler
from elastiserve.engine.sequence import Sequence, SequenceMetrics
from elastiserve.engine.step_budget import StepBudget, StepBudgetConfig
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
    assert b.tokens(40) == 2048  # another mode has no samples: no cap


def test_margin_is_the_90th_percentile_residual():
    b = budget(min_samples=10, window=10)
    noise = [0, 0, 0, 0, 0, 0, 0, 0, 0.004, -0.004]  # one step 4 ms slow, one 4 ms fast: the line stays
    for i, extra in enumerate(noise):
        b.record(0, 200 * (i + 1), 0.020 + 5e-5 * 200 * (i + 1) + extra)
    fit = b.fit(0)
    residuals = sorted(y - (fit.intercept_s + fit.per_token_s * x)
                       for x, y in [(200 * (i + 1), 0.020 + 1e-2 * (i + 1) + e) for i, e in enumerate(noise)])
    assert fit.margin_s == pytest.approx(residuals[8])
    assert b.tokens(0) == int((0.1 - fit.intercept_s - fit.margin_s) / fit.per_token_s)


def test_no_cap_without_enough_samples_spread_or_slope():
    b = budget(min_samples=3)
    b.record(0, 1000, 0.2)
    b.record(0, 2000, 0.3)
    assert b.tokens(0) == 2048  # two samples
    for _ in range(3):
        b.record(1, 1000, 0.5)
    assert b.tokens(1) == 2048  # no spread in tokens
    b.record(2, 500, 0.3), b.record(2, 1000, 0.2), b.record(2, 1500, 0.1)
    assert b.tokens(2) == 2048  # steps that got faster with more tokens: nothing to learn


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
            EngineConfig(model="x", max_step_time_s=kw["max_step_time_s"])


def test_scheduler_caps_chunks_and_admissions_but_never_decodes():
    kv = KVManager(FlatBlockPool(256), 4, num_host_slots=0)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=64)
    seqs = []
    for i in range(6):
        seq = Sequence(f"r{i}", [1] * 3, 3, SamplingParams(), SequenceMetrics(float(i)))
        sched.add(seq)
        seqs.append(seq)
    batch = sched.schedule()
    for i, seq in enumerate(batch.seqs):
        seq.num_computed_tokens += batch.num_new_tokens[i]
        seq.token_ids.append(5)
    long = Sequence("long", [1] * 50, 50, SamplingParams(), SequenceMetrics(9.0))
    sched.add(long)
    sched.step_tokens = 4  # fewer than the six decodes
    assert sched.dry_run().num_prefill_tokens == 0
    batch = sched.schedule()
    assert batch.num_new_tokens == [1] * 6 and long not in batch.seqs
    sched.step_tokens = 10
    batch = sched.schedule()
    assert batch.num_new_tokens == [1] * 6 + [4] and batch.seqs[-1] is long
    sched.step_tokens = None
    assert sched.token_budget == 64


def test_capped_engine_gives_the_same_greedy_tokens_in_capped_steps():
    def run(cap: int | None):
        model = random_fp16_model(small_llama_config(2, 256))
        config = EngineConfig(model="tiny", device="cpu", block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                              max_step_time_s=1.0 if cap else 60.0, cpu_kv_blocks=256)
        engine = LLMEngine(config, model=model, eos_token_ids=())
        if cap:  # a budget that has learned a line, 1 s at `cap` tokens, and learns nothing more
            engine.step_budget = StepBudget(StepBudgetConfig(1.0, 64, min_tokens=4))
            for tokens in (cap // 2, cap, 2 * cap):
                for _ in range(3):
                    engine.step_budget.record(0, tokens, tokens / cap)
            engine.step_budget.record = lambda *args: None
            assert engine.step_budget.tokens(0) == cap
        steps = []
        execute = engine.runner.execute
        engine.runner.execute = lambda batch, kv: (steps.append((batch.num_tokens, len(batch.seqs))),
                                                   execute(batch, kv))[1]
        prompts = [[(3 * i + s) % 97 for i in range(n)] for s, n in ((1, 40), (2, 23), (5, 61), (7, 9))]
        try:
            results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        finally:
            engine.close()
        if not cap:  # a bound no CPU step comes near: the engine learned every chunk-carrying step, and only those
            learned = list(engine.step_budget._steps[0])
            assert [t for t, _ in learned] == [t for t, n in steps if t > n] and all(s > 0 for _, s in learned)
        return [r.token_ids for r in results], steps

    tokens, steps = run(None)
    capped_tokens, capped_steps = run(16)
    assert capped_tokens == tokens
    assert max(t for t, _ in steps) > 16  # uncapped, prefill takes whole chunks
    assert all(t <= max(16, n) for t, n in capped_steps)  # capped: at most the cap, or one token per sequence
    assert len(capped_steps) > len(steps)
