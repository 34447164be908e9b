"""vLLM's request extras: ``include_stop_str_in_output`` keeps the stop string that ended the text,
``skip_special_tokens: false`` keeps special tokens' text, ``stream_options.continuous_usage_stats`` (with
``include_usage``) puts the tokens so far on every chunk, ``truncate_prompt_tokens`` keeps the prompt's last tokens;
wrong values are 400s; ``/version`` answers."""

from __future__ import annotations

import json
import urllib.request

import pytest
from fake_engine import SCRIPT
from served_app import post_raw

from elastiserve.engine.loader import smollm2_dir
from elastiserve.engine.tokenizer import StopChecker, TextStream, Tokenizer

pytestmark = [pytest.mark.cpu]


@pytest.mark.parametrize("include, expected", [(False, "say "), (True, "say ENDING")])
def test_stop_checker_cuts_before_or_after_the_stop_string(include, expected):
    checker, out = StopChecker(("END", "ENDING", "xyz"), include=include), ""
    for piece in ["sa", "y E", "NDING and more"]:  # "END" and "ENDING" start at once: the longer is the stop
        text, stopped = checker.feed(piece, final=False)
        out += text
        if stopped:
            break
    assert stopped and out == expected


def test_special_tokens_text_is_kept_on_request():
    tokenizer = Tokenizer.from_dir(smollm2_dir())
    end = tokenizer.backend.token_to_id("<|im_end|>")
    ids = [*tokenizer.encode("Hi there", add_special_tokens=False), end]
    assert TextStream(tokenizer).add(ids, final=True) == "Hi there"
    assert TextStream(tokenizer, skip_special_tokens=False).add(ids, final=True) == "Hi there<|im_end|>"


def completion(url, **extra):
    body = {"model": "test-model", "prompt": "Hi", "max_tokens": 40, "temperature": 0.0} | extra
    return post_raw(url, "/v1/completions", json.dumps(body).encode())


def test_include_stop_str_in_output(fake_served):
    stop = "fake"
    assert completion(fake_served.url, stop=[stop])[1]["choices"][0]["text"] == SCRIPT[:SCRIPT.index(stop)]
    kept = completion(fake_served.url, stop=[stop], include_stop_str_in_output=True)[1]["choices"][0]["text"]
    assert kept == SCRIPT[:SCRIPT.index(stop) + len(stop)]
    chunks = fake_served.client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=40, stop=[stop], stream=True,
        extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == kept


def stream_chunks(url, body):
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = [line.decode().strip() for line in response]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_continuous_usage_stats(fake_served):
    body = {"model": "test-model", "prompt": "Hi", "max_tokens": 6, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream_chunks(fake_served.url, body)
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counted == sorted(counted) and counted[-1] == 6 and len(counted) >= 6
    assert all(c["usage"]["prompt_tokens"] == 2 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 8
    body["stream_options"] = {"continuous_usage_stats": True}  # without include_usage: none, as in vLLM
    assert all("usage" not in c for c in stream_chunks(fake_served.url, body))


@pytest.mark.parametrize("extra, param", [
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options"),
])  # fmt: skip
def test_wrong_types_are_bad_requests(fake_served, extra, param):
    status, body = completion(fake_served.url, **extra)
    assert status == 400 and body["error"]["param"] == param


def test_truncate_prompt_tokens_keeps_the_last_tokens(fake_served):
    def prompt_tokens(**extra):
        status, body = completion(fake_served.url, prompt="Hello world", max_tokens=2, **extra)
        return status, body["usage"]["prompt_tokens"] if status == 200 else body["error"]["param"]

    assert prompt_tokens() == (200, 11)  # one token a byte
    assert prompt_tokens(truncate_prompt_tokens=3) == (200, 3)
    assert prompt_tokens(truncate_prompt_tokens=-1) == (200, 11)  # the context's length: nothing cut here
    assert prompt_tokens(truncate_prompt_tokens=0) == (400, "truncate_prompt_tokens")
    assert prompt_tokens(truncate_prompt_tokens=10_000) == (400, "truncate_prompt_tokens")


def test_version(fake_served):
    with urllib.request.urlopen(fake_served.url + "/version", timeout=30) as response:
        assert response.status == 200 and json.loads(response.read())["version"]
