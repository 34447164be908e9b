"""The collector's passes timed (``engine/gc_watch.py``) and the engine's step records carrying the collector's
seconds since the step before (``gc_s``), so that bench timelines tell host pauses from steps."""

from __future__ import annotations

import gc

import pytest
from tiny_models import random_fp16_model, small_llama_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.gc_watch import GcWatch
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams

pytestmark = [pytest.mark.cpu]


def test_the_watch_times_each_pass_by_generation_until_removed():
    watch = GcWatch()
    watch.install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        watch.remove()
    assert watch.collections[0] >= 1 and watch.collections[2] == 2
    assert watch.seconds[2] > 0 and watch.max_seconds[2] <= watch.seconds[2]
    assert watch.stats()["gc_full_collections"] == 2 and watch.total_s == pytest.approx(sum(watch.seconds))
    gc.collect(2)
    assert watch.collections[2] == 2 and watch._on_pass not in gc.callbacks


def test_a_step_records_the_collection_that_ran_before_it():
    model = random_fp16_model(small_llama_config(1, 256))
    config = EngineConfig(model="tiny", device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                          cpu_kv_blocks=64)
    engine = LLMEngine(config, model=model, eos_token_ids=())
    try:
        engine.add_request("a", [3] * 10, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        engine.step()
        before, full_s = engine.stats()["gc_full_collections"], engine.gc_watch.seconds[2]
        gc.collect(2)
        forced_s = engine.gc_watch.seconds[2] - full_s
        engine.step()
        stats = engine.stats()
        assert stats["gc_full_collections"] == before + 1 and stats["gc_s"] >= forced_s > 0
        assert stats["gc_s"] <= stats["gc_total_s"] and stats["gc_max_pause_s"] > 0
    finally:
        engine.close()
    assert engine.gc_watch._on_pass not in gc.callbacks


@pytest.fixture
def low_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(50, 2, 2)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def test_a_watch_that_takes_collection_over_runs_the_passes_cpython_would_only_when_asked(low_thresholds):
    watch, second = GcWatch(), GcWatch()
    watch.install()
    gc.collect()
    watch.take_over()
    second.take_over()
    try:
        assert not gc.isenabled() and watch.owns_collection
        assert watch.collect_due() is None  # nothing allocated since the full pass
        before = list(watch.collections)
        garbage = [[i] for i in range(200)]  # tracked containers: past the youngest generation's threshold of 50
        assert watch.collections == before  # no automatic pass while it holds collection
        generations = []
        for _ in range(16):  # due passes: gen0 three times, then gen1 (count1 > 2); gen2 once gen1 ran three times
            garbage += [[i] for i in range(60)]
            generations.append(watch.collect_due())
        assert generations[0] == 0 and 1 in generations and 2 in generations
        assert watch.collections[2] == before[2] + generations.count(2)
        assert watch.stats()["gc_in_step_shadow"] is True
        watch.release()
        assert not gc.isenabled()  # the second watch still holds it
    finally:
        watch.remove()
        second.release()
    assert gc.isenabled() and watch.collect_due() is None and not watch.stats()["gc_in_step_shadow"]


def test_the_runner_hands_the_device_shadow_to_host_work_once_per_forward():
    model = random_fp16_model(small_llama_config(1, 256))
    config = EngineConfig(model="tiny", device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                          cpu_kv_blocks=64)
    engine = LLMEngine(config, model=model, eos_token_ids=())
    calls = []
    try:
        assert gc.isenabled() and not engine.gc_watch.owns_collection  # the CPU keeps automatic collection
        engine.runner.host_work_in_shadow = lambda: calls.append(engine.step_count)
        engine.add_request("a", [3] * 10, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        assert len(calls) == steps == 3
    finally:
        engine.close()
