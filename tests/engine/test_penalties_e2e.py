"""Sampling penalties end to end: the engine hands each sampling sequence's own prompt and generated tokens to the
sampler, so that every greedy token it emits is the argmax of a plain forward's logits with the penalties applied
by hand (repetition over prompt and output, frequency and presence over the output), and a penalised request
decodes differently from an unpenalised one in the same batch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dense_context import DenseAttentionContext, positions_for
from tiny_models import random_fp16_model, small_llama_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams

pytestmark = [pytest.mark.cpu]

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 9, 11]
PENALISED = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, frequency_penalty=1.5,
                           presence_penalty=0.5, repetition_penalty=1.3)


def by_hand(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    counts = Counter(output)
    out = []
    for token, value in enumerate(logits):
        if p.repetition_penalty != 1.0 and (token in counts or token in prompt):
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        out.append(value - p.frequency_penalty * counts[token] - p.presence_penalty * (counts[token] > 0))
    return out


def test_greedy_tokens_are_the_penalised_argmax_of_a_plain_forward():
    model = random_fp16_model(small_llama_config(2, 128), scale=0.2)  # logits far enough apart to rank
    config = EngineConfig(model="tiny", device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                          cpu_kv_blocks=128)
    engine = LLMEngine(config, model=model, eos_token_ids=())
    try:
        engine.add_request("penalised", PROMPT, PENALISED)
        engine.add_request("plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        outputs: dict[str, list[int]] = {"penalised": [], "plain": []}
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
    finally:
        engine.close()
    assert outputs["penalised"] != outputs["plain"]
    checked = 0
    for name, params in (("penalised", PENALISED), ("plain", SamplingParams(temperature=0.0))):
        tokens = outputs[name]
        for k, token in enumerate(tokens):
            seq = PROMPT + tokens[:k]
            with torch.no_grad():
                ids = torch.tensor(seq)
                hidden = model(ids, positions_for([len(seq)]), DenseAttentionContext([len(seq)]))
                logits = model.compute_logits(hidden[-1:]).float()[0].tolist()
            scores = by_hand(logits, PROMPT, tokens[:k], params)
            best = max(range(len(scores)), key=scores.__getitem__)
            runner_up = max(s for t, s in enumerate(scores) if t != best)
            if scores[best] - runner_up > 1e-2:  # fp16 paged vs dense attention can swap a near-tie
                assert token == best, (name, k)
                checked += 1
    assert checked >= 15
