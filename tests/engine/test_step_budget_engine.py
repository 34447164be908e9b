"""The step-time token budget in the engine (its rules: tests/control/test_step_budget.py): the scheduler honours
the cap for chunks and admissions but never cuts decodes; and the engine, capped, produces the same greedy tokens
as uncapped in steps no longer than the cap, and learns from exactly the steps that carry a prefill chunk."""

from __future__ import annotations

import pytest
from tiny_models import random_fp16_model, small_llama_config

from elastiserve.control.step_budget import StepBudget, StepBudgetConfig
from elastiserve.engine.config import EngineConfig
from elastiserve.engine.kv_manager import FlatBlockPool, KVManager
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import Scheduler
from elastiserve.engine.sequence import Sequence, SequenceMetrics
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]


def test_engine_config_validates_the_bound():
    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match="max_step_time_s"):
            EngineConfig(model="x", max_step_time_s=bad)


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
            stats = engine.stats()  # the last step's size and time, for bench timelines
            assert (stats["step_tokens"], stats["step_seqs"]) == steps[-1] and stats["step_s"] > 0
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


class HeldBudget(StepBudget):
    """What two modes have learned, held: 8 tokens a step with every layer full, 64 with any layer fast."""

    def tokens(self, mode: int) -> int:
        return 8 if mode == 0 else 64

    def record(self, mode: int, tokens: int, seconds: float) -> None:
        pass


def test_a_switch_back_to_full_waits_for_a_step_budgeted_for_full():
    """The queue trigger releases FP8 after a step was scheduled at fast mode's budget: that step still runs fast,
    and the next is planned at full mode's budget and runs full (session 12 on the H200: such a step ran full in
    132 ms against a 123 ms TBT bound)."""
    from elastiserve.control.arbiter import Arbiter
    from elastiserve.control.config import preset

    model = random_fp16_model(small_llama_config(2, 256))
    config = EngineConfig(model="tiny", device="cpu", block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                          max_step_time_s=1.0, cpu_kv_blocks=256, policy="dps", queue_fast_after_s=600.0)
    control = preset("dps").with_engine_admission().with_precision(queue_fast_s=600.0, queue_fast_hold_s=0.0)
    engine = LLMEngine(config, model=model, policy=Arbiter(control, a_max=64), eos_token_ids=())
    engine.step_budget = HeldBudget(StepBudgetConfig(1.0, 64))
    every_layer = frozenset(range(2))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        engine.add_request("old", [3] * 6, params)
        engine.scheduler.find("old").metrics.arrival_time -= 1000.0  # waited past queue_fast_s
        engine.step()  # planned at full's 8 tokens, run fast: the trigger is on
        assert engine.runner.fast_layers == every_layer and engine.last_step["step_tokens"] == 6
        engine.add_request("new", [5] * 100, params)  # every old request has its first token: the trigger is off
        engine.step()
        assert engine.last_step["step_tokens"] == 64  # one decode and 63 prompt tokens, at fast mode's budget
        assert engine.runner.fast_layers == every_layer and engine.transitions.deferred_fast == 0
        engine.step()
        assert engine.last_step["step_tokens"] == 8 and engine.runner.fast_layers == frozenset()
        while engine.has_unfinished():
            engine.step()
            assert engine.last_step["step_tokens"] <= 8 and engine.runner.fast_layers == frozenset()
        counts = engine.events.counts()
        assert counts["mode_fast"] == 1 and counts["mode_full"] == 1
    finally:
        engine.close()


def test_prefill_fast_plans_chunks_at_the_all_fast_budget():
    """With ``prefill_fast`` a step that carries a prompt chunk runs every layer fast, so the chunk is planned at
    fast mode's budget (64 tokens here) even while the decode steps around it run full (8)."""
    from elastiserve.control.arbiter import Arbiter
    from elastiserve.control.config import preset

    model = random_fp16_model(small_llama_config(2, 256))
    config = EngineConfig(model="tiny", device="cpu", block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                          max_step_time_s=1.0, cpu_kv_blocks=256, policy="dps", prefill_fast=True)
    control = preset("dps").with_engine_admission().with_precision(prefill_fast=True)
    engine = LLMEngine(config, model=model, policy=Arbiter(control, a_max=64), eos_token_ids=())
    engine.step_budget = HeldBudget(StepBudgetConfig(1.0, 64))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        engine.add_request("a", [3] * 6, params)
        engine.step()  # the prompt, fast
        assert engine.runner.fast_layers == frozenset(range(2)) and engine.last_step["step_tokens"] == 6
        engine.step()  # a decode step, full
        assert engine.runner.fast_layers == frozenset() and engine.last_step["step_tokens"] == 1
        engine.add_request("b", [5] * 100, params)
        engine.step()  # one decode and 63 prompt tokens, at fast mode's budget, run fast
        assert engine.last_step["step_tokens"] == 64 and engine.runner.fast_layers == frozenset(range(2))
        while engine.has_unfinished():
            engine.step()
            fast = engine.runner.fast_layers
            assert fast == (frozenset() if engine.last_step["step_tokens"] == engine.last_step["step_seqs"]
                            else frozenset(range(2)))
    finally:
        engine.close()


def test_probe_steps_prime_the_budget_of_every_whole_model_mode():
    """The probe (``step_probe``): a quarter, a half, three quarters and all of the chunk budget, twice each, in each
    mode the policy reaches, written nowhere in the KV cache; the primed budget caps before any served step, and the
    served steps it learns from are the served ones only."""
    from elastiserve.engine import step_probe

    assert step_probe.probe_token_counts(512) == [128, 256, 384, 512] and step_probe.probe_token_counts(2) == [1, 2]
    inputs = step_probe.probe_inputs(40, vocab_size=97)
    assert inputs.slots == [-1] * 40 and len(set(inputs.tokens)) > 10 and all(0 <= t < 97 for t in inputs.tokens)
    model = random_fp16_model(small_llama_config(2, 1024))
    config = EngineConfig(model="tiny", device="cpu", block_size=4, max_num_seqs=8, max_num_batched_tokens=512,
                          max_step_time_s=1e-4, cpu_kv_blocks=256)
    engine = LLMEngine(config, model=model, eos_token_ids=())
    try:
        kv_before = engine.runner.kv_cache.clone()
        assert engine.step_budget.tokens(0) == 512  # on the CPU nothing is primed at start-up
        engine.prime_step_budget()
        primed = engine.step_budget._priors
        assert list(primed) == [0] and [t for t, _ in primed[0]] == [128, 128, 256, 256, 384, 384, 512, 512]
        assert all(seconds > 0 for _, seconds in primed[0])
        assert engine.runner.kv_cache.equal(kv_before) and engine.runner.fast_layers == frozenset()
        assert engine.step_budget.tokens(0) == 256  # a 0.1 ms bound no CPU step meets: the floor (min_tokens)
        result = engine.generate([[5] * 300], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0]
        assert len(result.token_ids) == 2
        assert [t for t, _ in engine.step_budget._steps[0]] == [256, 44]  # served chunks, capped from the first
    finally:
        engine.close()


def test_probe_runs_each_mode_and_puts_the_runner_back():
    """dps reaches two whole-model modes: the probe times both (keyed by their number of fast layers), one untimed
    run before each size's timed ones, and leaves the runner in the mode it found, also when a run fails."""
    from elastiserve.engine import step_probe
    from elastiserve.engine.warmup import mode_sets

    class Runner:
        def __init__(self, fail_at=None):
            self.fast_layers, self.runs, self.fail_at = frozenset({1}), [], fail_at

        def set_fast_layers(self, fast):
            self.fast_layers = fast

        def run(self, inputs):
            if len(self.runs) == self.fail_at:
                raise RuntimeError("device lost")
            self.runs.append((len(self.fast_layers), len(inputs.tokens)))

        def synchronize(self):
            pass

    sets = mode_sets(EngineConfig(model="x", policy="dps"), 4)
    runner = Runner()
    times = step_probe.probe_step_times(runner, sets, [8, 16], vocab_size=50)
    assert {mode: [t for t, _ in steps] for mode, steps in times.items()} == {0: [8, 8, 16, 16], 4: [8, 8, 16, 16]}
    assert runner.runs == [(0, 8)] * 3 + [(0, 16)] * 3 + [(4, 8)] * 3 + [(4, 16)] * 3
    assert runner.fast_layers == frozenset({1})
    failing = Runner(fail_at=5)
    with pytest.raises(RuntimeError, match="device lost"):
        step_probe.probe_step_times(failing, sets, [8, 16], vocab_size=50)
    assert failing.fast_layers == frozenset({1})
