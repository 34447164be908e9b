"""Chat requests as vLLM users write them: ``chat_template_kwargs`` reach the template, ``add_generation_prompt`` /
``continue_final_message`` shape the prompt (SmolLM2's template renders what transformers renders), ``--chat-template``
replaces the model's; ``--reasoning-parser`` splits ``<think>`` text into ``reasoning_content``, whole and streamed
alike at every place a stream may cut it, and the content after it still carries tool calls."""

from __future__ import annotations

import itertools
import json

import pytest
import transformers
from fake_engine import FakeEngine
from served_app import Served, post_raw

from elastiserve.engine.chat_render import load_chat_template, open_final_message, render_chat
from elastiserve.engine.loader import smollm2_dir, smollm2_gguf_path
from elastiserve.engine.protocol import TemplateOptions, parse_chat
from elastiserve.engine.reasoning import FORMATS, ReasoningStream, reasoning_format, split_reasoning
from elastiserve.engine.request_fields import BadRequest
from elastiserve.engine.tokenizer import Tokenizer
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]

USER = [{"role": "user", "content": "Hi"}]


def chat_body(**extra):
    return {"model": "m", "messages": extra.pop("messages", USER), **extra}


# ---- reasoning split -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, text, expected", [
    ("qwen3", "<think>\nplan\n</think>\n\nAnswer", ("\nplan\n", "\n\nAnswer")),
    ("qwen3", "  <think>x</think>y", ("x", "y")),
    ("qwen3", "Answer without thinking", (None, "Answer without thinking")),
    ("qwen3", "<thinking is not the tag>", (None, "<thinking is not the tag>")),
    ("qwen3", "<think>cut by max_tokens", ("cut by max_tokens", None)),
    ("qwen3", "<think></think>only content", ("", "only content")),
    ("qwen3", "", (None, "")),
    ("deepseek_r1", "plan</think>Answer", ("plan", "Answer")),
    ("deepseek_r1", "<think>plan</think>Answer", ("plan", "Answer")),
    ("deepseek_r1", "all reasoning", ("all reasoning", None)),
    ("deepseek_r1", "a</think>b</think>c", ("a", "b</think>c")),  # only the first end tag ends the reasoning
])  # fmt: skip
def test_split_reasoning(name, text, expected):
    assert split_reasoning(text, FORMATS[name]) == expected


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("text", ["<think>\nplan A</think>\n\nThe answer.", " <think>x</thi", "plan</think>ok",
                                  "<th", "no tags at all", "<think>a</think>b</think>"])
def test_streamed_deltas_equal_the_whole_split_wherever_the_stream_cuts(name, text):
    fmt = FORMATS[name]
    whole_reasoning, whole_content = split_reasoning(text, fmt)
    cuts = [[i] for i in range(len(text) + 1)] + [list(range(1, len(text)))]  # one cut anywhere; every character
    for points in cuts:
        bounds = [0, *points, len(text)]
        stream, deltas = ReasoningStream(fmt), []
        for start, end in itertools.pairwise(bounds):
            deltas += stream.feed(text[start:end])
        deltas += stream.finish()
        assert all(len(d) == 1 and next(iter(d.values())) for d in deltas), deltas  # no empty delta is sent
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        assert reasoning == (whole_reasoning or "") and content == (whole_content or ""), (points, deltas)
        kinds = [next(iter(d)) for d in deltas]
        assert kinds == sorted(kinds, key=lambda k: k == "content")  # reasoning, then content, never back


def test_unknown_reasoning_parser_is_a_config_error():
    assert reasoning_format(None) is None
    with pytest.raises(ConfigError, match="unknown reasoning parser 'r1'"):
        reasoning_format("r1")


# ---- template options ------------------------------------------------------------------------------------------

def test_parse_chat_template_options():
    options = parse_chat(chat_body(chat_template_kwargs={"enable_thinking": False})).template
    assert options == TemplateOptions({"enable_thinking": False}, add_generation_prompt=True)
    assert not parse_chat(chat_body(add_generation_prompt=False)).template.add_generation_prompt
    cont = parse_chat(chat_body(messages=[*USER, {"role": "assistant", "content": "Hel"}],
                                continue_final_message=True)).template
    assert cont.continue_final_message and not cont.add_generation_prompt


@pytest.mark.parametrize("extra, words", [
    ({"chat_template_kwargs": ["x"]}, "must be an object"),
    ({"chat_template_kwargs": {"messages": []}}, "may not set ['messages']"),
    ({"add_generation_prompt": "yes"}, "must be a boolean"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
    ({"continue_final_message": True, "messages": [{"role": "assistant", "content": "  "}]}, "text to continue"),
])  # fmt: skip
def test_bad_template_options_are_bad_requests(extra, words):
    with pytest.raises(BadRequest) as info:
        parse_chat(chat_body(**extra))
    assert words in info.value.message


@pytest.fixture(scope="module")
def smollm2():
    gguf = smollm2_gguf_path()
    reference = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return Tokenizer.from_dir(smollm2_dir()), reference


@pytest.mark.parametrize("final", ["The capital is", "Sure! "])
def test_continue_final_message_renders_what_transformers_renders(smollm2, final):
    tokenizer, reference = smollm2
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": final}]
    options = parse_chat(chat_body(messages=messages, continue_final_message=True)).template
    ours = render_chat(tokenizer, messages, options)
    theirs = reference.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours == theirs and ours.endswith(final)


def test_open_final_message_refuses_a_template_that_drops_the_text():
    with pytest.raises(BadRequest, match="does not render the final message"):
        open_final_message("<user>Hi\n<assistant>\n", "Hello there")


def test_chat_template_override_and_its_variables(smollm2, tmp_path):
    tokenizer = Tokenizer.from_dir(smollm2_dir())
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}{{ 'think' if enable_thinking else 'answer' }}:{% endif %}")
    tokenizer.set_chat_template(load_chat_template(str(path)))
    rendered = [render_chat(tokenizer, USER, TemplateOptions({"enable_thinking": flag})) for flag in (True, False)]
    assert rendered == ["user: Hi\nthink:", "user: Hi\nanswer:"]
    assert load_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"  # inline, as vLLM takes it
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="does not compile"):
        tokenizer.set_chat_template("{% for m in messages %}")
    assert smollm2[0].chat_template != tokenizer.chat_template  # one tokenizer's override, not the model's



def test_a_template_variable_too_deep_to_render_is_a_bad_request():
    tokenizer = Tokenizer.from_dir(smollm2_dir())
    tokenizer.set_chat_template("{{ messages[0].content }}{{ deep | tojson }}")
    deep = []
    for _ in range(5000):  # built in a loop: deeper than any recursive renderer goes
        deep = [deep]
    with pytest.raises(BadRequest, match="nested too deep"):
        render_chat(tokenizer, USER, TemplateOptions({"deep": deep}))
    assert render_chat(tokenizer, USER, TemplateOptions({"deep": [[1]]})) == "Hi[[1]]"

# ---- over HTTP --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking_served():
    script = ('<think>Paris is the capital.</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"city": '
              '"Paris"}}\n</tool_call>')
    engine = FakeEngine(num_blocks=256, step_delay_s=0.002, script=script)
    engine.config.max_model_len = engine.max_model_len = 1024  # room for the tools' system text and the answer
    served = Served(engine, reasoning_parser="qwen3")
    yield served
    served.close()


def test_template_options_reach_the_prompt(fake_served):
    status, body = post_raw(fake_served.url, "/tokenize", json.dumps(chat_body(
        model="test-model", chat_template_kwargs={"enable_thinking": False})).encode())
    assert status == 200 and bytes(body["tokens"]).decode() == "[enable_thinking=False]<user>Hi\n<assistant>"
    messages = [*USER, {"role": "assistant", "content": "Hel"}]
    status, body = post_raw(fake_served.url, "/tokenize", json.dumps(chat_body(
        model="test-model", messages=messages, continue_final_message=True)).encode())
    assert status == 200 and bytes(body["tokens"]).decode() == "<user>Hi\n<assistant>Hel"
    status, body = post_raw(fake_served.url, "/v1/chat/completions", json.dumps(chat_body(
        model="test-model", chat_template_kwargs={"tools": []})).encode())
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"


def test_reasoning_content_whole_and_streamed(thinking_served):
    client = thinking_served.client
    whole = client.chat.completions.create(model="test-model", messages=USER, max_tokens=200)
    message = whole.choices[0].message
    assert message.reasoning_content == "Paris is the capital."
    assert message.content.startswith("\n\n<tool_call>")  # no tools offered: the block is content
    chunks = list(client.chat.completions.create(model="test-model", messages=USER, max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content


def test_reasoning_then_tool_call(thinking_served):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    client = thinking_served.client
    whole = client.chat.completions.create(model="test-model", messages=USER, max_tokens=200, tools=tools)
    choice = whole.choices[0]
    assert choice.message.reasoning_content == "Paris is the capital." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("lookup", {"city": "Paris"})]
    chunks = list(client.chat.completions.create(model="test-model", messages=USER, max_tokens=200, tools=tools,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Paris is the capital."
    arguments = "".join(call.function.arguments or "" for d in deltas for call in d.tool_calls or [])
    assert json.loads(arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
