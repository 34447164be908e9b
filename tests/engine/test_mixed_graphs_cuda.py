"""CUDA only: with ``EngineConfig.mixed_graphs`` the steps that carry prefill chunks replay captured graphs padded to
token and sequence buckets, and their hidden states match the eager unpadded steps'. The Llama case passed on the
H200 in session 8 (ff71540); the Qwen3-MoE case, whose padding rows route to no expert, is newer (ci/gpu/README.md)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_fp16_model, small_llama_config, small_moe_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.graphs import StepShape
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams

pytestmark = [pytest.mark.cuda]


def tiny_engine(device, mixed_graphs: bool, moe: bool = False) -> LLMEngine:
    config = small_moe_config(2, 512) if moe else small_llama_config(2, 512)
    model = random_fp16_model(config, device=str(device))
    options = dict(model="tiny", device="cuda", block_size=16, max_num_seqs=16, max_num_batched_tokens=300,
                   max_model_len=512, kv_cache_budget=16 << 20, graph_capture_after=1, mixed_graphs=mixed_graphs)
    return LLMEngine(EngineConfig(**options), model=model, eos_token_ids=())


@pytest.mark.parametrize("moe", [False, True], ids=["llama", "qwen3-moe"])
def test_mixed_graph_replays_equal_the_eager_steps(device, moe):
    """Every step that carries a prefill chunk is run twice: eagerly, unpadded, and from its padded graph; the
    last-token hidden states agree within fp16 tolerance (the graph's attention grid and query tile are sized for
    the token bucket, so it may sum in another order). With MoE layers the padding rows route to no expert."""
    engine = tiny_engine(device, mixed_graphs=True, moe=moe)
    runner = engine.runner
    checked = []
    run = runner.run

    def run_and_compare(inputs, sample=True):
        num_seqs, num_tokens = len(inputs.seq_lens), len(inputs.tokens)
        shape = runner.graphs.step_shape(num_tokens, num_seqs, is_decode=all(n == 1 for n in inputs.query_lens))
        if shape is not None and shape.mixed:
            meta = runner.load_inputs(inputs)
            eager = runner.forward(num_tokens, meta)[meta.query_start_loc[1:] - 1].clone()
            meta = runner.load_inputs(inputs, shape)
            graphed = runner.graphs.run(shape, meta)[meta.query_start_loc[1 : num_seqs + 1] - 1]
            torch.testing.assert_close(graphed, eager, atol=2e-3, rtol=2e-3)
            checked.append(shape)
        return run(inputs, sample)

    runner.run = run_and_compare
    try:
        # The model has 97 tokens; the lengths make a step of 257 + 39 + 7 tokens and ragged later chunks.
        prompts = [[(7 * i + start) % 97 for i in range(n)] for start, n in ((1, 39), (3, 257), (5, 7), (2, 188))]
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        mixed_keys = [key for key in runner.graphs.graphs if key[0].mixed]
    finally:
        engine.close()
    assert [len(r.token_ids) for r in results] == [12] * 4
    assert checked and mixed_keys and all(key[0].tokens >= 256 for key in mixed_keys)
    assert all(isinstance(shape, StepShape) and shape.batch >= 16 for shape in checked)


def test_the_step_budget_is_primed_at_start_up_through_the_mixed_graphs(device):
    """With a step-time bound a GPU engine times probe steps after warm-up (``step_probe``) in both whole-model modes
    of dps, through the captured mixed-step graphs, writing nothing into the KV cache; then it serves."""
    from elastiserve.engine.step_probe import probe_token_counts

    model = random_fp16_model(small_moe_config(2, 512), device=str(device))
    config = EngineConfig(model="tiny", device="cuda", policy="dps", block_size=16, max_num_seqs=16,
                          max_num_batched_tokens=300, max_model_len=512, kv_cache_budget=16 << 20,
                          mixed_graphs=True, max_step_time_s=0.5)  # fmt: skip
    engine = LLMEngine(config, model=model, eos_token_ids=())
    try:
        primed = engine.step_budget._priors
        sizes = [t for t in probe_token_counts(300) for _ in range(2)]
        assert sorted(primed) == [0, 2] and all([t for t, _ in primed[m]] == sizes for m in primed)
        assert all(0 < seconds < 0.5 for m in primed for _, seconds in primed[m])
        assert engine.runner.fast_layers == frozenset()
        # Bytes, not fp16 values: dps's KV pool maps the shared region, whose units hold weight residuals in full
        # mode, and a residual byte pair read as fp16 can be a NaN (unequal to itself).
        kv_before = engine.runner.kv_cache.view(torch.int16).clone()
        engine.prime_step_budget()
        torch.cuda.synchronize()
        assert engine.runner.kv_cache.view(torch.int16).equal(kv_before)
        prompts = [[(7 * i + start) % 97 for i in range(n)] for start, n in ((1, 39), (3, 257))]
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finally:
        engine.close()
    assert [len(r.token_ids) for r in results] == [6, 6]
