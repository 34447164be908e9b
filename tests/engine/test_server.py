"""OpenAI-compatible server: the official `openai` client (streaming and not), 400 bodies for bad input, 401 without
the API key, a client disconnect mid-stream freeing the request's blocks, engine failures failing only their requests,
and a parseable /metrics page. Sampling fields: test_server_sampling.py; structured output and tools:
test_server_structured.py.

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
from fake_engine import SCRIPT, FakeEngine
from served_app import MODEL, Served, openai, post_raw

from elastiserve.engine.async_engine import AsyncEngine

pytestmark = [pytest.mark.cpu]


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
