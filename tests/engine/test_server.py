"""OpenAI-compatible server: the official `openai` client (streaming and not), 400 bodies for bad input, 401 without
the API key, a client disconnect mid-stream freeing the request's blocks, engine failures failing only their requests,
and a parseable /metrics page.

Tests taking ``served`` run twice: against the fake engine and against the real `LLMEngine` on SmolLM2 (CPU).
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request

import pytest

try:
    import openai
except ImportError:  # the GPU image has no openai client; these cpu-marked tests run where it is installed (CI)
    openai = None
from fake_engine import SCRIPT, FakeEngine

from elastiserve.engine.async_engine import AsyncEngine
from elastiserve.engine.server import BackgroundServer, build_app

pytestmark = [pytest.mark.cpu]
MODEL = "test-model"


def real_engine():
    from elastiserve.engine.config import EngineConfig
    from elastiserve.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model="smollm2", device="cpu", max_model_len=256, max_num_seqs=4, cpu_kv_blocks=128, policy="static-fp16"
        )
    )


class Served:
    def __init__(self, engine, api_key=None):
        self.engine = engine
        self.async_engine = AsyncEngine(engine).start()
        self.app = build_app(self.async_engine, engine.tokenizer, model_name=MODEL, api_key=api_key)
        self.server = BackgroundServer(self.app).__enter__()
        self.url = self.server.base_url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0, timeout=120)

    def close(self):
        self.server.__exit__(None, None, None)
        self.async_engine.shutdown()

    def on_engine(self, fn):
        return self.async_engine.submit(fn).result(30)

    def wait_idle(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.on_engine(self.engine.has_unfinished):
                return True
            time.sleep(0.05)
        return False


@pytest.fixture(scope="module", params=["fake", "smollm2"])
def served(request):
    engine = FakeEngine(num_blocks=256, step_delay_s=0.005) if request.param == "fake" else real_engine()
    s = Served(engine)
    s.kind = request.param
    yield s
    s.close()


@pytest.fixture(scope="module")
def fake_served():
    s = Served(FakeEngine(num_blocks=256, step_delay_s=0.005))
    yield s
    s.close()


def post_raw(url, path, body: bytes, headers=None):
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_models_and_health(served):
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    with urllib.request.urlopen(served.url + "/health", timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"


def test_completion_stream_equals_non_stream(served):
    args = dict(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
    )
    full = served.client.completions.create(**args)
    assert full.usage.completion_tokens == 6 and full.choices[0].finish_reason == "length"
    prompt_tokens = len(served.engine.tokenizer.encode("The capital of France is"))
    assert full.usage.prompt_tokens == prompt_tokens
    assert full.usage.total_tokens == prompt_tokens + 6
    chunks = list(served.client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


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


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "prompt"), (["a", [1, 2]], "prompt"), ([[1, 2], []], "prompt"), (["x"] * 257, "at most 256"),
     ([True, 2], "prompt")],
)
def test_bad_prompt_batches_get_400(fake_served, prompt, message):
    status, payload = post_raw(fake_served.url, "/v1/completions",
                               json.dumps({"model": MODEL, "prompt": prompt}).encode())
    assert status == 400 and payload["error"]["param"] == "prompt" and message in payload["error"]["message"]
    status, payload = post_raw(fake_served.url, "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": ["a"] * 17, "n": 60, "best_of": 64, "temperature": 1.0}).encode())
    assert status == 400 and "1024" in payload["error"]["message"]


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


def test_tokenize_and_detokenize(served):
    """vLLM's /tokenize (a prompt, or chat messages through the template) and /detokenize, with 400s."""
    tokenizer = served.engine.tokenizer
    status, body = post_raw(served.url, "/tokenize", json.dumps({"model": MODEL, "prompt": "Hello world"}).encode())
    assert status == 200 and body["tokens"] == list(tokenizer.encode("Hello world"))
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    messages = [{"role": "user", "content": "Hi"}]
    status, chat = post_raw(served.url, "/tokenize", json.dumps({"messages": messages}).encode())
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert status == 200 and chat["tokens"] == (list(tokenizer.encode(rendered)) if isinstance(rendered, str)
                                                else list(rendered))
    status, text = post_raw(served.url, "/detokenize", json.dumps({"tokens": body["tokens"]}).encode())
    assert status == 200 and text["prompt"] == tokenizer.decode(body["tokens"])
    for path, bad, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"model": "x", "prompt": "a"},
                             "model"), ("/detokenize", {"tokens": [1, -1]}, "tokens"), ("/detokenize", {}, "tokens")):
        status, payload = post_raw(served.url, path, json.dumps(bad).encode())
        assert status == 400 and payload["error"]["param"] == param, (path, bad)


def test_chat_stream_and_non_stream(served):
    messages = [{"role": "user", "content": "Say hello."}]
    full = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.0)
    assert full.choices[0].message.role == "assistant"
    assert 1 <= full.usage.completion_tokens <= 5
    rendered = served.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected_prompt = len(served.engine.tokenizer.encode(rendered)) if isinstance(rendered, str) else len(rendered)
    assert full.usage.prompt_tokens == expected_prompt
    stream = served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0.0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "nope", "prompt": "hi"}, "model"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1.0}, None),
        ({"model": MODEL, "prompt": "hi", "top_p": 0.0}, None),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
        ({"model": MODEL, "prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
        ({"model": MODEL, "prompt": "hi", "min_p": 1.5}, None),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, None),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"3": "up"}}, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"3": 101}}, None),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, None),
        ({"model": MODEL, "prompt": "hi", "best_of": 65}, "best_of"),
        ({"model": MODEL, "prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
        ({"model": MODEL, "prompt": "hi", "best_of": 2, "temperature": 0.0}, "best_of"),
        ({"model": MODEL, "prompt": 5}, "prompt"),
        ({"model": MODEL, "prompt": "hi " * 400, "max_tokens": 4}, "max_tokens"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "frequency_penalty": 2.5}, None),
        ({"model": MODEL, "prompt": "hi", "presence_penalty": "lots"}, "presence_penalty"),
        ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0.0}, None),
        ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"model": MODEL, "prompt": "hi", "logprobs": True}, "logprobs"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ({"model": MODEL, "prompt": "def f(", "suffix": "    return x"}, "suffix"),
        ({"model": MODEL, "prompt": "hi", "suffix": 3}, "suffix"),
    ],
)
def test_bad_completion_requests_get_400(served, body, param):
    status, payload = post_raw(served.url, "/v1/completions", json.dumps(body).encode())
    assert status == 400
    error = payload["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_json_and_bad_chat_get_400(served):
    status, payload = post_raw(served.url, "/v1/completions", b"{not json")
    assert status == 400 and "malformed JSON" in payload["error"]["message"]
    bad_chat = json.dumps({"model": MODEL, "messages": "hi"}).encode()
    status, payload = post_raw(served.url, "/v1/chat/completions", bad_chat)
    assert status == 400 and payload["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=65)
    assert info.value.status_code == 400 and "'n'" in str(info.value)
    no_flag = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).encode()
    status, payload = post_raw(served.url, "/v1/chat/completions", no_flag)
    assert status == 400 and payload["error"]["param"] == "top_logprobs"


def open_stream(url, max_tokens, n=1):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {
        "model": MODEL,
        "prompt": "Count: one two three",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
        "n": n,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_mid_stream_frees_blocks(served, n):
    assert served.wait_idle()
    conn, resp = open_stream(served.url, max_tokens=200, n=n)
    assert resp.status == 200
    assert resp.read(7) == b"data: {"  # read() undoes the chunked transfer encoding
    assert served.on_engine(served.engine.has_unfinished)  # still generating when we leave
    conn.sock.close()
    conn.close()
    assert served.wait_idle(), "the aborted request is still in the engine"
    stats = served.async_engine.last_stats
    if served.kind == "fake":
        assert stats["num_used_blocks"] == 0 and served.engine.aborted
    assert served.async_engine.num_in_flight == 0


def test_api_key_required():
    s = Served(FakeEngine(), api_key="sekret")
    try:
        assert s.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 401
        status, payload = post_raw(s.url, "/v1/completions", b"{}")
        assert status == 401 and payload["error"]["code"] == "invalid_api_key"
        with urllib.request.urlopen(s.url + "/health", timeout=10) as resp:  # health stays open for probes
            assert resp.status == 200
    finally:
        s.close()


def test_stop_strings_and_multibyte_streaming(fake_served):
    client = fake_served.client
    full = client.completions.create(model=MODEL, prompt="x", max_tokens=200)
    assert full.choices[0].text == SCRIPT and full.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model=MODEL, prompt="x", max_tokens=200, stream=True)
    )
    assert streamed == SCRIPT  # multi-byte characters arrive whole
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=200, stop=["☃ and", "zzz"], stream=stream)
        text = out.choices[0].text if not stream else "".join(c.choices[0].text for c in out)
        assert text == SCRIPT[: SCRIPT.index("☃ and")]
    past = len(SCRIPT[: SCRIPT.index("☃ and") + 5].encode())  # bytes (the fake's tokens) through the stop string
    for stream in (False, True):  # min_tokens past the stop string: it does not count (vLLM's rule)
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=200, stop=["☃ and"], stream=stream,
                                        extra_body={"min_tokens": past})
        text = out.choices[0].text if not stream else "".join(c.choices[0].text for c in out)
        assert text == SCRIPT
    assert fake_served.wait_idle()


@pytest.mark.parametrize("n", [1, 2])
def test_engine_failure_fails_requests_not_server(fake_served, n):
    assert fake_served.wait_idle()
    errors = fake_served.async_engine.step_errors
    fake_served.engine.fail_next_step = True
    with pytest.raises(openai.InternalServerError):
        fake_served.client.completions.create(model=MODEL, prompt="x", max_tokens=3, n=n)
    assert fake_served.wait_idle()  # no choice is left running
    out = fake_served.client.completions.create(model=MODEL, prompt="x", max_tokens=3, n=n)
    assert [c.text for c in out.choices] == [SCRIPT[:3]] * n
    assert fake_served.async_engine.step_errors == errors + 1


def test_overload_queues_and_all_complete():
    s = Served(FakeEngine(num_blocks=12, max_num_seqs=8))  # room for about two requests at a time
    try:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(
                pool.map(
                    lambda i: s.client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=20, temperature=0.0),
                    range(6),
                )
            )
        assert all(r.choices[0].text == SCRIPT[:20] for r in results)
        assert s.engine.used_blocks == 0
    finally:
        s.close()


SAMPLE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? '
    r"(-?[0-9.e+-]+|\+Inf|-Inf|NaN)$"
)


def test_metrics_page_parses(fake_served):
    fake_served.client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    fake_served.on_engine(lambda: None)  # an op refreshes the cached stats
    with urllib.request.urlopen(fake_served.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* ", line), line
            continue
        assert SAMPLE.match(line), f"not a Prometheus sample: {line!r}"
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    assert samples["elastiserve_requests_total"] >= 1
    assert samples["elastiserve_time_to_first_token_seconds_count"] >= 1
    assert (
        samples['elastiserve_time_to_first_token_seconds_bucket{le="+Inf"}']
        == samples["elastiserve_time_to_first_token_seconds_count"]
    )
    assert samples["elastiserve_kv_usage"] == 0.0
    assert samples['elastiserve_mode{value="full"}'] == 1
    assert samples["elastiserve_preemptions"] == 0


def test_async_engine_direct_use():
    """Leaving the iterator early aborts the request; add_request errors propagate; a stopped engine refuses work."""
    import asyncio
    import contextlib

    from elastiserve.engine.async_engine import EngineStopped
    from elastiserve.engine.errors import InvalidRequest
    from elastiserve.engine.sampling import SamplingParams

    engine = FakeEngine(step_delay_s=0.002)
    with pytest.raises(EngineStopped):
        AsyncEngine(engine).submit(lambda: None)
    async_engine = AsyncEngine(engine).start()

    async def scenario():
        seen = []
        outputs = async_engine.generate("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                seen.extend(out.new_token_ids)
                if len(seen) == 3:
                    break
        with pytest.raises(InvalidRequest):
            async for _ in async_engine.generate("b", [1, 2], SamplingParams(temperature=-1.0)):
                pass
        full = [t async for out in async_engine.generate("c", [5], SamplingParams(max_tokens=4)) for t in
                out.new_token_ids]
        return seen, full, await async_engine.stats()

    try:
        seen, full, stats = asyncio.run(scenario())
        assert seen == full[:3] == list(SCRIPT.encode()[:3]) and len(full) == 4
        assert async_engine.submit(lambda: engine.aborted).result(10) == ["a"]
        assert stats["num_used_blocks"] == 0 and async_engine.num_in_flight == 0
    finally:
        async_engine.shutdown()
    assert not async_engine.is_running


def test_idle_async_engine_steps_until_background_work_is_done():
    """A server with no requests still restores residuals and promotes pairs: those progress only per step."""
    engine = FakeEngine()
    engine.background_steps = 20
    async_engine = AsyncEngine(engine).start()
    try:
        deadline = time.monotonic() + 10
        while engine.has_background_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_background_work()
        steps = engine.num_steps
        time.sleep(0.1)  # nothing left: the thread waits instead of stepping
        assert engine.num_steps == steps
    finally:
        async_engine.shutdown()


# ---- structured output and tools (SmolLM2: the fake engine's script is no JSON) ------------------------------
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                  "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}},
]


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)
def test_response_format_json_object_and_json_schema(served):
    """json_object's output parses as one object; json_schema's (streamed too) conforms to the schema, types checked
    by hand; both end with finish_reason stop once the document is complete."""
    ask = [{"role": "user", "content": 'Give a JSON object with the keys "city" and "country" for Paris.'}]
    full = served.client.chat.completions.create(model=MODEL, messages=ask, max_tokens=30, temperature=0.0,
                                                 response_format={"type": "json_object"}).choices[0]
    assert full.finish_reason == "stop" and isinstance(json.loads(full.message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=30,
                temperature=0.0, response_format=fmt)
    full = served.client.chat.completions.create(**args).choices[0]
    person = json.loads(full.message.content)
    assert full.finish_reason == "stop" and set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 10
    assert isinstance(person["age"], int) and not isinstance(person["age"], bool)
    chunks = list(served.client.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)
def test_guided_choice_with_n_choices(served):
    """Each of n sampled choices (its own guide) is exactly one of the strings."""
    choices = ["Paris", "London", "Rome"]
    out = served.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, n=3,
                                           temperature=1.0, seed=7, extra_body={"guided_choice": choices})
    assert len(out.choices) == 3
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices), [c.text for c in out.choices]


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)
def test_guided_regex_output_matches_as_a_whole(served):
    """completions and chat: the text matches the regex as re.fullmatch does, and ends once nothing may follow; a
    schema's ``pattern`` holds in the JSON string."""
    phone = r"\d{3}-\d{4}"
    out = served.client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, temperature=0.0,
                                           extra_body={"guided_regex": phone}).choices[0]
    assert re.fullmatch(phone, out.text) and out.finish_reason == "stop", out.text
    answer = "(yes|no), [a-z]{1,8}\\."
    full = served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=16, temperature=1.0,
        seed=3, extra_body={"guided_regex": answer}).choices[0]
    assert re.fullmatch(answer, full.message.content) and full.finish_reason == "stop", full.message.content
    schema = {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
              "additionalProperties": False}
    out = served.client.completions.create(model=MODEL, prompt="The zip code as JSON:", max_tokens=20, temperature=0.0,
                                           extra_body={"guided_json": schema}).choices[0]
    assert re.fullmatch("[0-9]{5}", json.loads(out.text)["zip"]) and out.finish_reason == "stop", out.text


def streamed_answer(chunks):
    """A streamed choice put together as a client does: (content, [(name, arguments)], ids, argument fragments,
    finish reason); each call's start is checked to come first, once, with its id, and its fragments after it."""
    content, calls, ids, fragments = "", [], [], 0
    for chunk in chunks:
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta and delta.content) or ""
        for call in (delta and delta.tool_calls) or []:
            if call.id is not None:  # a call's start: the next index, its name, no arguments yet
                assert call.index == len(calls) and call.type == "function" and not call.function.arguments
                calls.append([call.function.name, ""])
                ids.append(call.id)
            else:
                assert call.index < len(calls) and call.function.name is None and call.function.arguments
                calls[call.index][1] += call.function.arguments
                fragments += 1
    return content, [tuple(c) for c in calls], ids, fragments, chunks[-1].choices[0].finish_reason


def check_city_calls(calls):
    for name, arguments in calls:
        assert name in ("get_weather", "get_time", "get_date"), name
        parsed = json.loads(arguments)
        assert set(parsed) == ({"city", "unit"} if name == "get_weather" else {"city"}), arguments
        assert isinstance(parsed["city"], str) and len(parsed["city"]) <= 12


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)
def test_tool_choice_named_streams_the_call_as_it_is_generated(served):
    """named: that tool's one call; streamed, its start then its arguments in several fragments, which add up to the
    whole answer's arguments; both finish with "tool_calls" and no content."""
    named = {"type": "function", "function": {"name": "get_time"}}
    args = dict(model=MODEL, messages=[{"role": "user", "content": "What is the time in Paris?"}], max_tokens=30,
                temperature=0.0, tools=WEATHER_TOOLS, tool_choice=named)
    full = served.client.chat.completions.create(**args).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None
    (call,) = full.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_time"
    check_city_calls([(call.function.name, call.function.arguments)])
    content, calls, ids, fragments, reason = streamed_answer(list(served.client.chat.completions.create(
        **args, stream=True)))
    assert content == "" and reason == "tool_calls" and ids[0].startswith("call_")
    assert calls == [("get_time", call.function.arguments)] and fragments > 1


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}
CITY_TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": CITY}},
              {"type": "function", "function": {"name": "get_date", "parameters": CITY}}]  # a short prompt


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)
@pytest.mark.parametrize("parallel", [False, True])
def test_tool_choice_required_makes_one_or_more_calls(served, parallel):
    """required: an array of calls, as vLLM reads it; with parallel_tool_calls false exactly one, else one or more
    (seed 3 is one where SmolLM2 makes two, so the limit is the grammar's). The stream sends the same calls, each
    started once with its own id, its arguments in fragments that add up to the whole answer's."""
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Time and date in Paris?"}], max_tokens=50,
                temperature=1.0, seed=3, tools=CITY_TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    full = served.client.chat.completions.create(**args).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in full.message.tool_calls]
    assert len(calls) >= 2 if parallel else len(calls) == 1, calls
    check_city_calls(calls)
    assert len({c.id for c in full.message.tool_calls}) == len(calls)
    content, streamed, ids, fragments, reason = streamed_answer(list(served.client.chat.completions.create(
        **args, stream=True)))
    assert content == "" and reason == "tool_calls" and streamed == calls
    assert len(set(ids)) == len(calls) and fragments > len(calls)


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)
def test_auto_tool_call_streams_between_content(served):
    """auto: a <tool_call> block in the text (a regex makes SmolLM2 write one) is a call, the rest content; the stream
    sends the content before it as it comes, then the call, and agrees with the whole answer."""
    regex = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"city": "[A-Z][a-z]{1,7}"\}\}</tool_call>'
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Time in Paris?"}], max_tokens=40,
                temperature=0.0, tools=CITY_TOOLS, extra_body={"guided_regex": regex})
    full = served.client.chat.completions.create(**args).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content == "Sure."
    (call,) = full.message.tool_calls
    check_city_calls([(call.function.name, call.function.arguments)])
    content, calls, _, fragments, reason = streamed_answer(list(served.client.chat.completions.create(
        **args, stream=True)))
    assert content == "Sure. " and reason == "tool_calls" and fragments > 1
    assert calls == [("get_time", call.function.arguments)]


@pytest.mark.parametrize("served", ["smollm2"], indirect=True)
def test_tool_results_and_earlier_calls_render_through_the_template(served):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0.0)
    assert out.choices[0].finish_reason in ("stop", "length")
    status, payload = post_raw(served.url, "/tokenize", json.dumps({"messages": messages}).encode())
    text = served.engine.tokenizer.decode(payload["tokens"])
    assert status == 200 and '<tool_call>\n{"name": "get_weather"' in text and "<tool_response>" in text


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "string", "pattern": "(?=a)"}}}}, "response_format", "pattern"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"guided_json": '{"type": "object", "properties": {"d": {"format": "date"}}}'}, "guided_json", "format"),
    ({"guided_json": "{not json"}, "guided_json", "JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "(a)\\1"}, "guided_regex", "backreference"),
    ({"guided_regex": "(a"}, "guided_regex", "')'"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar", "not supported"),
    ({"guided_choice": ["a"], "guided_json": {}}, "guided_choice", "only one"),
    ({"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "nope"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 1}}}],
      "tool_choice": "required"}, "tools", "minimum"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": WEATHER_TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, "tool_choice", "already"),
    ({"tools": WEATHER_TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls",
     "boolean"),
    ({"tools": WEATHER_TOOLS, "parallel_tool_calls": 0}, "parallel_tool_calls", "boolean"),
])
def test_bad_structured_requests_get_400(fake_served, extra, param, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | extra
    status, payload = post_raw(fake_served.url, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and payload["error"]["param"] == param, payload
    assert words in payload["error"]["message"]
