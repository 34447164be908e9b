"""CUDA only: under per-layer granularity (combined) the engine captures, before serving, the graphs of every prefix
of whole layer groups, the mixes between all-full and all-fast without a warm-up forward each
(``GraphRunner.capture_common(warm_up=False)``); a replay of such a graph equals the eager forward of its mix."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_fp16_model, small_moe_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.warmup import graph_mode_sets

pytestmark = [pytest.mark.cuda]

NUM_LAYERS = 4  # combined's 4 layer groups: one layer each, so three mixes lie between all-full and all-fast


def test_group_prefix_graphs_are_captured_and_replay_like_eager(device):
    model = random_fp16_model(small_moe_config(NUM_LAYERS, 512), device=str(device))
    config = EngineConfig(model="tiny", device="cuda", policy="combined", block_size=16, max_num_seqs=16,
                          max_num_batched_tokens=300, max_model_len=512, kv_cache_budget=16 << 20,
                          mixed_graphs=True)  # fmt: skip
    engine = LLMEngine(config, model=model, eos_token_ids=())
    runner = engine.runner
    prefixes = graph_mode_sets(config, NUM_LAYERS)
    mixes = prefixes[1:-1]
    assert [len(p) for p in prefixes] == [0, 1, 2, 3, 4]
    assert {key[1] for key in runner.graphs.graphs} == set(prefixes)
    before = len(runner.graphs.graphs)
    checked = []
    run = runner.run

    def run_and_compare(inputs, sample=True):
        num_seqs, num_tokens = len(inputs.seq_lens), len(inputs.tokens)
        shape = runner.graphs.step_shape(num_tokens, num_seqs, is_decode=all(n == 1 for n in inputs.query_lens))
        if shape is not None:
            for fast in mixes:  # each mix's forward rewrites this step's KV slots; the real step below writes last
                runner.set_fast_layers(fast)
                meta = runner.load_inputs(inputs)
                eager = runner.forward(num_tokens, meta)[meta.query_start_loc[1:] - 1].clone()
                meta = runner.load_inputs(inputs, shape)
                graphed = runner.graphs.run(shape, meta)[meta.query_start_loc[1 : num_seqs + 1] - 1]
                torch.testing.assert_close(graphed, eager, atol=2e-3, rtol=2e-3)
                checked.append((shape, fast))
            runner.set_fast_layers(frozenset())
        return run(inputs, sample)

    runner.run = run_and_compare
    try:
        prompts = [[(7 * i + start) % 97 for i in range(n)] for start, n in ((1, 39), (3, 257), (5, 7))]
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        after = len(runner.graphs.graphs)
    finally:
        engine.close()
    assert [len(r.token_ids) for r in results] == [8] * 3
    assert {fast for _, fast in checked} == set(mixes)
    assert any(shape.mixed for shape, _ in checked) and any(not shape.mixed for shape, _ in checked)
    assert after == before  # every key met was captured before serving
