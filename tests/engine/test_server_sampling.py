"""The server's sampling fields end to end through the `openai` client: penalties, logprobs (completions and chat),
echo scoring, n choices, best_of, batches of prompts, logit_bias and min_p.

Tests taking ``served`` run against the fake engine and SmolLM2 on the CPU; those that need a real sampler only the
latter.
"""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from served_app import MODEL

pytestmark = [pytest.mark.cpu]


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)  # the fake engine has no sampler
def test_penalties_reach_the_sampler(served):
    """Greedy SmolLM2 repeats itself on this prompt ("-to-many-to-many"); with penalties (OpenAI's fields and vLLM's
    repetition_penalty, as an extra body field) it repeats fewer tokens."""
    args = dict(model=MODEL, prompt="one-to-one, one-to-many, many", max_tokens=10, temperature=0.0,
                extra_body={"ignore_eos": True})
    plain = served.client.completions.create(**args).choices[0].text
    penalised = served.client.completions.create(
        **(args | {"extra_body": {"ignore_eos": True, "repetition_penalty": 1.5}}), frequency_penalty=2.0,
        presence_penalty=1.0).choices[0].text
    tokenizer = served.engine.tokenizer
    plain_ids, penalised_ids = tokenizer.encode(plain), tokenizer.encode(penalised)
    assert len(set(plain_ids)) < len(plain_ids), plain  # the unpenalised text repeats tokens
    assert len(set(penalised_ids)) > len(set(plain_ids)), (plain, penalised)


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)  # the fake engine has no sampler
def test_logprobs_completions_and_chat(served):
    """Completions: ``logprobs`` N gives tokens, their logprobs, N alternatives each and text offsets, equal between
    a stream and a full response; chat: ``logprobs`` with ``top_logprobs``. The sampled token's logprob is at most
    the best alternative's, and a token's text is its piece of the output."""
    args = dict(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0.0, logprobs=3,
                extra_body={"ignore_eos": True})
    full = served.client.completions.create(**args).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == full.text and lp.text_offset[0] == 0
    assert all(len(top) == 3 and max(top.values()) >= chosen - 1e-4 for top, chosen in
               zip(lp.top_logprobs, lp.token_logprobs))
    assert all(chosen <= 0 for chosen in lp.token_logprobs)
    chunks = [c for c in served.client.completions.create(**args, stream=True) if c.choices]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    streamed_lp = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.tokens and streamed_lp == pytest.approx(lp.token_logprobs, abs=1e-4)
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert 1 <= len(content) <= 4 and all(len(item.top_logprobs) == 2 for item in content)
    assert all(bytes(item.bytes).decode() == item.token for item in content)
    plain = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4, temperature=0.0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)  # the fake engine has no sampler
def test_echo_with_logprobs_scores_the_prompt(served):
    """lm-eval's loglikelihood request: ``echo`` with ``logprobs`` and ``max_tokens`` 0 returns the prompt and a logprob
    for each of its tokens but the first (null, as OpenAI writes it). With tokens to generate, the same prompt
    logprobs come first and the generated ones follow; a stream sends the prompt's with the echoed text."""
    prompt = "The quick brown fox jumps over the lazy dog"
    scored = served.client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == prompt and scored.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert "".join(lp.tokens) == prompt and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == scored.usage.prompt_tokens
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    more = served.client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0.0, extra_body={"ignore_eos": True}).choices[0]
    n = len(lp.tokens)
    assert more.logprobs.tokens[:n] == lp.tokens and len(more.logprobs.tokens) == n + 3
    assert more.logprobs.token_logprobs[1:n] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
    assert more.text == prompt + "".join(more.logprobs.tokens[n:])
    chunks = [c for c in served.client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1,
                                                          max_tokens=2, stream=True) if c.choices]
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.tokens == lp.tokens


def test_n_choices_stream_and_non_stream(served):
    """``n`` choices: one engine request each (seeds seed, seed + 1, ...), indices 0..n-1, usage summed; a stream
    interleaves them, each choice closed by its own finish reason, with the texts of the full response."""
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=11, n=3,
                extra_body={"ignore_eos": True})
    full = served.client.completions.create(**args)
    assert [c.index for c in full.choices] == [0, 1, 2] and full.usage.completion_tokens == 15
    if isinstance(served.engine, FakeEngine):  # the later choices name the first as their prefix leader
        leaders = {rid: leader for rid, leader in served.engine.prefix_leaders.items() if rid.endswith(("-1", "-2"))}
        assert leaders and all(leader == rid[:-2] + "-0" for rid, leader in leaders.items())
    assert all(c.finish_reason == "length" for c in full.choices)
    again = served.client.completions.create(**args)
    assert [c.text for c in again.choices] == [c.text for c in full.choices]  # seeded choices reproduce
    if not isinstance(served.engine, FakeEngine):
        assert len({c.text for c in full.choices}) > 1  # different seeds, different samples
    texts, finishes = {0: "", 1: "", 2: ""}, {}
    for chunk in served.client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in full.choices} and finishes == {0: "length", 1: "length", 2: "length"}
    chat = served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, n=2, temperature=0.0)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == \
        chat.choices[1].message.content  # greedy: the same twice
    assert served.wait_idle()


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)  # the fake engine has no sampler
def test_best_of_returns_the_candidates_of_the_highest_logprob_per_token(served):
    """``best_of`` 4, ``n`` 2: the four seeded candidates are the four choices of ``n`` 4 (seeds seed .. seed + 3),
    and the answer is the two of the highest mean token logprob, best first, with no logprobs unless asked; usage
    counts all four candidates' tokens."""
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7,
                extra_body={"ignore_eos": True})
    every = served.client.completions.create(**args, n=4, logprobs=0)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices]
    assert len(set(means)) == 4  # distinct samples, so the ranking is decided
    order = sorted(range(4), key=lambda i: -means[i])
    assert order[:2] != [0, 1]  # the seed is chosen so that the best are not the first two: ranking is needed
    best = served.client.completions.create(**args, n=2, best_of=4)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [every.choices[i].text for i in order[:2]]
    assert all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == 4 * 6
    with_logprobs = served.client.completions.create(**args, n=1, logprobs=2, best_of=4)
    choice = with_logprobs.choices[0]
    assert choice.text == every.choices[order[0]].text and len(choice.logprobs.top_logprobs[0]) == 2
    assert sum(choice.logprobs.token_logprobs) / 6 == pytest.approx(means[order[0]], abs=1e-4)
    assert served.wait_idle()


def test_a_batch_of_prompts_gives_each_its_choices(served):
    """A completions ``prompt`` that is a list (strings or token-id lists, as lm-eval sends batches): prompt p's
    choices have indices p * n .. p * n + n - 1 with the texts each prompt gives alone, usage counts every prompt
    once and every choice's tokens, echo repeats each choice's own prompt, and a stream carries the same texts."""
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    args = dict(model=MODEL, max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
    alone = [served.client.completions.create(prompt=p, **args).choices[0].text for p in prompts]
    batch = served.client.completions.create(prompt=prompts, n=2, **args)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [text for text in alone for _ in range(2)]
    prompt_tokens = sum(len(served.engine.tokenizer.encode(p)) for p in prompts)
    assert batch.usage.prompt_tokens == prompt_tokens and batch.usage.completion_tokens == 6 * 4
    ids = [served.engine.tokenizer.encode(p) for p in prompts[:2]]
    echoed = served.client.completions.create(prompt=ids, echo=True, **args)
    assert [c.text for c in echoed.choices] == [p + text for p, text in zip(prompts[:2], alone)]
    texts = {}
    for chunk in served.client.completions.create(prompt=prompts, stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == dict(enumerate(alone))
    assert served.wait_idle()


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)  # the fake engine has no sampler
def test_best_of_ranks_each_prompt_of_a_batch_apart(served):
    """best_of 3, n 1 over two prompts: each prompt's choice is the best of its own three candidates."""
    prompts = ["Once upon a time", "The weather today"]
    args = dict(model=MODEL, max_tokens=5, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    best_texts, best_index = [], []
    for prompt in prompts:
        every = served.client.completions.create(prompt=prompt, n=3, logprobs=0, **args).choices
        means = [sum(c.logprobs.token_logprobs) / 5 for c in every]
        best_index.append(max(range(3), key=lambda i: (means[i], -i)))
        best_texts.append(every[best_index[-1]].text)
    assert any(best_index)  # the seed is chosen so that some prompt's best is not its first candidate
    batch = served.client.completions.create(prompt=prompts, n=1, best_of=3, **args)
    assert [c.index for c in batch.choices] == [0, 1] and [c.text for c in batch.choices] == best_texts
    assert batch.usage.completion_tokens == 2 * 3 * 5
    assert served.wait_idle()


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)  # the fake engine has no sampler
def test_logit_bias_and_min_p_reach_the_sampler(served):
    """OpenAI's ``logit_bias`` (+100 on one token makes greedy pick it every time, -100 bans the token greedy picked)
    and vLLM's ``min_p`` (1.0 keeps only the most likely token, so sampling equals greedy)."""
    tokenizer = served.engine.tokenizer
    forced = tokenizer.encode(" banana")[-1]
    args = dict(model=MODEL, prompt="The capital of France is", max_tokens=4, logprobs=0)
    plain = {"ignore_eos": True}
    out = served.client.completions.create(**args, temperature=0.0, logit_bias={str(forced): 100}, extra_body=plain)
    assert [tokenizer.encode(t)[-1] for t in out.choices[0].logprobs.tokens] == [forced] * 4
    greedy = served.client.completions.create(**args, temperature=0.0, extra_body=plain).choices[0]
    first = tokenizer.encode(greedy.logprobs.tokens[0])[-1]
    banned = served.client.completions.create(**args, temperature=0.0, logit_bias={str(first): -100},
                                              extra_body=plain).choices[0]
    assert banned.logprobs.tokens[0] != greedy.logprobs.tokens[0]
    sampled = served.client.completions.create(**args, temperature=1.5, seed=3,
                                               extra_body={"ignore_eos": True, "min_p": 1.0}).choices[0]
    assert sampled.text == greedy.text
