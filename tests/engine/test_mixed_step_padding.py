"""A step that carries a prefill chunk, padded as a mixed CUDA graph pads it (``EngineConfig.mixed_graphs``:
padding sequences with no queries, tokens past the real ones that belong to no sequence, the attention grid sized
for the padded token count), gives the same last-token hidden states as the unpadded step, and writes no KV for its
padding. The CPU has no CUDA graphs: this runs the padded inputs eagerly, which is what a capture records."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_fp16_model, small_llama_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams

pytestmark = [pytest.mark.cpu]


def tiny_engine() -> LLMEngine:
    model = random_fp16_model(small_llama_config(2, 128))
    options = dict(model="tiny", device="cpu", block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                   cpu_kv_blocks=64, mixed_graphs=True)
    return LLMEngine(EngineConfig(**options), model=model, eos_token_ids=())


def test_padded_mixed_step_equals_the_unpadded_step():
    engine = tiny_engine()
    runner = engine.runner
    checked = []
    run = runner.run

    def run_and_compare(inputs, sample=True):
        if any(n > 1 for n in inputs.query_lens) and len(inputs.query_lens) > 1:
            num_seqs, num_tokens = len(inputs.seq_lens), len(inputs.tokens)
            meta = runner.buffers.load(inputs)
            plain = runner.forward(num_tokens, meta)[meta.query_start_loc[1:] - 1].clone()
            cache_before = runner.kv_cache.clone()
            meta = runner.buffers.load(inputs, padded_batch=num_seqs + 3, padded_tokens=num_tokens + 11)
            assert meta.max_query_len == num_tokens + 11 and meta.slot_mapping.shape[0] == num_tokens + 11
            padded = runner.forward(num_tokens + 11, meta)[meta.query_start_loc[1 : num_seqs + 1] - 1]
            torch.testing.assert_close(padded, plain, atol=1e-3, rtol=1e-3)
            assert torch.equal(runner.kv_cache, cache_before)  # the real tokens' K/V again, nothing for padding
            checked.append((num_seqs, num_tokens))
        return run(inputs, sample)

    runner.run = run_and_compare
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add_request("a", [5, 6, 7, 8, 9], params)
        engine.add_request("b", [11, 12, 13], params)
        for _ in range(2):
            engine.step()
        engine.add_request("c", list(range(20, 33)), params)  # a 13-token prompt beside two decodes
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()
    assert checked and all(seqs >= 2 and tokens > seqs for seqs, tokens in checked)
