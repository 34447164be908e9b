"""Sampling penalties and logprobs end to end. The engine hands each sampling sequence's own prompt and generated
tokens to the sampler, so that every greedy token it emits is the argmax of a plain forward's logits with the
penalties applied by hand (repetition over prompt and output, frequency and presence over the output), and a
penalised request decodes differently from an unpenalised one in the same batch. Logprobs are the raw model's."""

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


def test_logprobs_are_the_raw_log_softmax_of_a_plain_forward():
    """Each sampled token's logprob and its top alternatives equal log_softmax of a dense forward's logits (before
    the penalties and temperature that chose the token), within fp16 attention tolerance."""
    model = random_fp16_model(small_llama_config(2, 128), scale=0.2)
    config = EngineConfig(model="tiny", device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                          cpu_kv_blocks=128)
    engine = LLMEngine(config, model=model, eos_token_ids=())
    asks = {"top3": SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True, logprobs=3,
                                   frequency_penalty=1.0),
            "only-chosen": SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0),
            "none": SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)}
    try:
        for name, params in asks.items():
            engine.add_request(name, PROMPT, params)
        seen: dict[str, list] = {name: [] for name in asks}
        tokens: dict[str, list[int]] = {name: [] for name in asks}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                seen[out.request_id].append(out.logprobs)
    finally:
        engine.close()
    assert all(entry is None for entry in seen["none"])
    for name in ("top3", "only-chosen"):
        for k, (entries, token) in enumerate(zip(seen[name], tokens[name])):
            (entry,) = entries
            seq = PROMPT + tokens[name][:k]
            with torch.no_grad():
                hidden = model(torch.tensor(seq), positions_for([len(seq)]), DenseAttentionContext([len(seq)]))
                expected = torch.log_softmax(model.compute_logits(hidden[-1:]).float()[0], dim=-1)
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(expected[token].item(), abs=2e-2)
            assert len(entry.top) == asks[name].logprobs
            for token_id, logprob in entry.top:
                assert logprob == pytest.approx(expected[token_id].item(), abs=2e-2)
            if entry.top:
                assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
                assert entry.top[0][1] == pytest.approx(expected.max().item(), abs=2e-2)


def test_prompt_logprobs_across_chunks_and_scoring_only():
    """A 30-token prompt in 8-token chunks: every prompt token after the first gets the logprob a dense forward of
    the prompt gives it, with 2 alternatives; the first has none. ``max_tokens=0`` scores the prompt and stops."""
    model = random_fp16_model(small_llama_config(2, 128), scale=0.2)
    config = EngineConfig(model="tiny", device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                          cpu_kv_blocks=128)
    prompt = [(7 * i + 3) % 97 for i in range(30)]
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), positions_for([30]), DenseAttentionContext([30]))
        expected = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
    engine = LLMEngine(config, model=model, eos_token_ids=())
    try:
        engine.add_request("score", prompt, SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2))
        engine.add_request("gen", prompt, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0,
                                                         ignore_eos=True))
        firsts, finals = {}, {}
        while engine.has_unfinished():
            for out in engine.step():
                firsts.setdefault(out.request_id, out)
                if out.finished:
                    finals[out.request_id] = out
    finally:
        engine.close()
    assert finals["score"].new_token_ids == [] and finals["score"].num_output_tokens == 0
    assert finals["score"].finish_reason == "length" and len(finals["gen"].new_token_ids) == 1
    for name, width in (("score", 2), ("gen", 0)):
        entries = firsts[name].prompt_logprobs
        assert [e.token_id for e in entries] == prompt and entries[0].logprob is None
        for k in range(1, 30):
            assert entries[k].logprob == pytest.approx(expected[k - 1, prompt[k]].item(), abs=2e-2), (name, k)
            assert len(entries[k].top) == width
            for token_id, logprob in entries[k].top:
                assert logprob == pytest.approx(expected[k - 1, token_id].item(), abs=2e-2)
    assert firsts["gen"].prompt_logprobs is not None and finals["gen"].prompt_logprobs is None  # sent once


def test_prompt_rows_skip_what_an_earlier_pass_scored():
    """After a preemption the prompt is prefilled again from token 0; rows whose targets already have a logprob are
    not scored twice, and the rows of a chunk that ends inside the prompt stop at the prompt's last token."""
    from elastiserve.engine.kv_manager import FlatBlockPool, KVManager
    from elastiserve.engine.outputs import TokenLogprob
    from elastiserve.engine.scheduler import ScheduledBatch
    from elastiserve.engine.sequence import Sequence, SequenceMetrics
    from elastiserve.engine.step_inputs import gather_step_inputs

    kv = KVManager(FlatBlockPool(64), 4, num_host_slots=0)
    prompt = list(range(10, 22))  # 12 tokens
    other = Sequence("plain", list(range(5)), 5, SamplingParams(), SequenceMetrics(0.0))
    seq = Sequence("scored", [*prompt, 99], 12, SamplingParams(prompt_logprobs=1), SequenceMetrics(0.0))
    seq.prompt_logprobs = [TokenLogprob(10, None)] + [TokenLogprob(t, -1.0) for t in prompt[1:7]]  # 1..6 scored
    assert kv.allocate(other, 5) and kv.allocate(seq, 13)
    batch = ScheduledBatch(seqs=[other, seq], num_new_tokens=[5, 13])  # recompute: the whole prompt and token 99
    inputs = gather_step_inputs(batch, kv)
    # rows 6..10 of seq predict prompt tokens 7..11; seq's rows start after other's 5 tokens
    assert inputs.prompt_rows == [(1, 5 + 6, prompt[7:12], 1)]
    seq.prompt_logprobs += [TokenLogprob(t, -1.0) for t in prompt[7:]]
    assert gather_step_inputs(batch, kv).prompt_rows == []  # all scored


def test_min_tokens_keeps_eos_and_stop_tokens_out_until_reached():
    """vLLM's ``min_tokens``: with EOS set to the token greedy picks first, a plain request stops at once; with
    min_tokens 4 the first four tokens are the greedy tokens with EOS and the stop tokens banned, and the request
    may stop from the fifth on. ``ignore_eos`` drops EOS from the ban; min_tokens over max_tokens is refused."""
    from elastiserve.engine.errors import InvalidRequest

    model = random_fp16_model(small_llama_config(2, 128), scale=0.2)
    config = EngineConfig(model="tiny", device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                          cpu_kv_blocks=128)
    probe = LLMEngine(config, model=model, eos_token_ids=())
    try:
        free = probe.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids
    finally:
        probe.close()
    eos = free[0]
    stop = next(t for t in free if t != eos)  # a stop token greedy meets later without the ban
    engine = LLMEngine(config, model=model, eos_token_ids=(eos,))
    try:
        plain = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0]
        assert plain.token_ids == [eos] and plain.finish_reason == "stop"
        engine.add_request("min", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4,
                                                         stop_token_ids=(stop,)))
        seq = engine.scheduler.find("min")
        assert set(seq.banned_before_min) == {eos, stop}
        while engine.has_unfinished():
            engine.step()
        tokens = seq.output_token_ids
        assert len(tokens) >= 4 and not {eos, stop} & set(tokens[:4])
        assert seq.finish_reason == "length" or tokens[-1] in (eos, stop)
        for k, token in enumerate(tokens[:4]):  # each is the argmax with the two banned
            ids = PROMPT + tokens[:k]
            with torch.no_grad():
                hidden = model(torch.tensor(ids), positions_for([len(ids)]), DenseAttentionContext([len(ids)]))
                logits = model.compute_logits(hidden[-1:]).float()[0]
            logits[[eos, stop]] = float("-inf")
            assert token == int(logits.argmax())
        engine.add_request("kept", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2,
                                                          ignore_eos=True))
        assert engine.scheduler.find("kept").banned_before_min == ()
        engine.abort_request("kept")
        with pytest.raises(InvalidRequest, match="min_tokens"):
            engine.add_request("bad", PROMPT, SamplingParams(max_tokens=2, min_tokens=3))
    finally:
        engine.close()
