"""Structured output and tools through the server (SmolLM2 on the CPU: the fake engine's script is no JSON):
response_format json_object / json_schema, guided_choice and guided_regex, tool_choice named / required / auto,
tool results through the chat template, and 400s for what the grammar cannot take.
"""

from __future__ import annotations

import json
import re

import pytest
from served_app import MODEL, post_raw

pytestmark = [pytest.mark.cpu]


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
