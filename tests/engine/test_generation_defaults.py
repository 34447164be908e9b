"""The server's default sampling values from a model's generation_config.json (vLLM's ``--generation-config auto``):
the fields vLLM reads, transformers' top-k 0 as ours -1, bad files refused at start-up; and over HTTP, a request's own
values win, and a chat request without max_tokens may use the rest of the context."""

from __future__ import annotations

import json

import pytest
from fake_engine import SCRIPT, FakeEngine
from served_app import Served

from elastiserve.engine.generation_defaults import generation_defaults, parse_generation_config
from elastiserve.engine.server_generation import STATE_KEY
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def test_qwen3s_file_gives_its_recommended_values(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    expected = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert generation_defaults("auto", tmp_path) == expected
    assert generation_defaults(str(tmp_path), None) == expected  # a folder
    assert generation_defaults(str(tmp_path / "generation_config.json"), None) == expected  # a file
    assert generation_defaults("none", tmp_path) == {}
    assert generation_defaults("auto", tmp_path / "elsewhere") == {}  # a model without the file: ours
    assert generation_defaults("auto", None) == {}  # a built-in config


def test_fields_and_conversions():
    got = parse_generation_config({"top_k": 0, "max_new_tokens": 512, "repetition_penalty": 1.05, "min_p": 0,
                                   "max_length": 4096, "num_beams": 4, "top_p": None})
    assert got == {"top_k": -1, "max_tokens": 512, "repetition_penalty": 1.05, "min_p": 0.0}


@pytest.mark.parametrize("config, words", [
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"top_k": 2.5}, "top_k must be a whole number"),
    ({"top_p": 1.5}, "top_p=1.5 must be in (0, 1]"),
    ({"temperature": True}, "temperature must be a finite number"),
    ([], "expected a JSON object"),
])  # fmt: skip
def test_bad_values_stop_the_start(config, words):
    with pytest.raises(ConfigError) as info:
        parse_generation_config(config)
    assert words in str(info.value)


def test_a_named_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        generation_defaults(str(tmp_path), None)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        generation_defaults("auto", tmp_path)


@pytest.fixture
def defaults_served():
    engine = FakeEngine(num_blocks=256, step_delay_s=0.002)
    served = Served(engine)
    yield served
    served.close()


def served_with(served, defaults):
    served.app[STATE_KEY].default_sampling = defaults
    return served


def test_defaults_fill_what_a_request_leaves_out(defaults_served):
    client = served_with(defaults_served, {"max_tokens": 5, "temperature": 0.0}).client
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="test-model", messages=messages)
    assert chat.choices[0].message.content == SCRIPT[:5] and chat.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="test-model", messages=messages, max_tokens=3)
    assert chat.choices[0].message.content == SCRIPT[:3]  # the request's own value wins
    completion = client.completions.create(model="test-model", prompt="Hi")
    assert completion.choices[0].text == SCRIPT[:5]


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(defaults_served):
    client = served_with(defaults_served, {}).client
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="test-model", messages=messages)
    assert chat.choices[0].message.content == SCRIPT and chat.choices[0].finish_reason == "stop"  # not cut at 16
    assert client.completions.create(model="test-model", prompt="Hi").choices[0].text == SCRIPT[:16]  # OpenAI's 16
    served_with(defaults_served, {"max_tokens": 10_000})  # a default over the context is capped
    chat = client.chat.completions.create(model="test-model", messages=messages)
    assert chat.choices[0].message.content == SCRIPT
    served_with(defaults_served, {}).app[STATE_KEY].max_sequence_tokens = 40  # a KV pool shorter than the context
    chat = client.chat.completions.create(model="test-model", messages=messages)  # its prompt is 20 bytes
    assert chat.choices[0].message.content == SCRIPT[:20] and chat.choices[0].finish_reason == "length"
    long = [{"role": "user", "content": "x" * 600}]  # the fake's context is 512 tokens (bytes)
    with pytest.raises(Exception, match="maximum context length is 512"):
        client.chat.completions.create(model="test-model", messages=long)


def test_an_engine_caps_a_requests_tokens_at_its_kv_pool():
    from tiny_models import random_fp16_model, small_llama_config

    from elastiserve.engine.config import EngineConfig
    from elastiserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", block_size=4, cpu_kv_blocks=8, max_model_len=4096),
                       model=random_fp16_model(small_llama_config(2, 4096)), eos_token_ids=())
    try:
        assert engine.max_sequence_tokens == engine.kv.pool.num_blocks * 4 < engine.max_model_len == 4096
    finally:
        engine.close()
