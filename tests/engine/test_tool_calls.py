"""Tool calls without a model: ``<tool_call>`` blocks parsed out of text, a stream holding them back (and a tail that
may start one), forced calls, the Hermes-style prompt for templates without tools, and the forced call grammar."""

from __future__ import annotations

import json
import random

import pytest

from elastiserve.engine import tool_calls
from elastiserve.engine.structured import ToolSpec, parse_tools, tool_grammar

pytestmark = pytest.mark.cpu

TOOLS = ({"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
         {"type": "function", "function": {"name": "now"}})
AUTO = ToolSpec(TOOLS, "auto")


def test_auto_parses_blocks_and_keeps_the_rest_as_content():
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>{"name": ' \
           '"now", "arguments": {}}</tool_call>'
    content, calls = tool_calls.parse_tool_calls(text, AUTO)
    assert content == "Sure."
    assert [c["function"]["name"] for c in calls] == ["add", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert tool_calls.parse_tool_calls("no calls here", AUTO) == ("no calls here", [])
    # an unknown function or broken JSON is not a call: the text stays content
    assert tool_calls.parse_tool_calls('<tool_call>{"name": "rm"}</tool_call>', AUTO)[1] == []
    assert tool_calls.parse_tool_calls('<tool_call>{"name": "add", </tool_call>', AUTO)[1] == []
    _, (unclosed,) = tool_calls.parse_tool_calls('<tool_call>{"name": "now", "arguments": {}}', AUTO)
    assert unclosed["function"]["name"] == "now"


def test_auto_without_parallel_calls_keeps_the_first_call_only():
    """parallel_tool_calls false on "auto": the first call is the answer's; a later block's call is dropped, in a
    stream (no delta of index 1) as in the whole answer, and its block is not content either."""
    text = 'Sure.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and <tool_call>{"name": ' \
           '"now", "arguments": {}}</tool_call>'
    single = ToolSpec(TOOLS, "auto", parallel=False)
    content, calls = tool_calls.parse_tool_calls(text, single)
    assert content == "Sure. and" and [c["function"]["name"] for c in calls] == ["add"]
    assert len(tool_calls.parse_tool_calls(text, AUTO)[1]) == 2
    stream = tool_calls.ToolCallStream(single)
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    indices = {d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d}
    assert indices == {0}
    assert "".join(d["content"] for d in deltas if "content" in d) == "Sure. and "
    assert tool_calls.finish_reason(stream.kept_calls(), "stop") == "tool_calls"


def test_stream_holds_back_only_a_possible_opening_tag():
    stream = tool_calls.ToolCallStream(AUTO)
    pieces = ["Let me ", "check <to", 'ol_call>{"name": "now", ', '"arguments": {}}', "</tool_call>"]
    sent = [stream.feed(piece) for piece in pieces]
    assert sent[:3] == [[{"content": "Let me "}], [{"content": "check "}], []]
    (start,), (fragment,) = sent[3][0]["tool_calls"], sent[3][1]["tool_calls"]
    assert start == {"index": 0, "id": stream.calls[0].id, "type": "function",
                     "function": {"name": "now", "arguments": ""}}
    assert fragment == {"index": 0, "function": {"arguments": "{}"}} and len(sent[3]) == 2
    assert sent[4] == [] and stream.finish() == []
    plain = tool_calls.ToolCallStream(AUTO)
    assert plain.feed("a <t") == [{"content": "a "}] and plain.feed("ip>") == [{"content": "<tip>"}]
    assert plain.finish() == [] and plain.calls == []
    cut = tool_calls.ToolCallStream(AUTO)
    assert cut.feed("so <tool_") == [{"content": "so "}] and cut.finish() == [{"content": "<tool_"}]


def test_forced_output_is_calls_and_its_grammar_checks_arguments():
    spec = ToolSpec(TOOLS, "named", "add")
    assert tool_calls.parse_tool_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', spec)[0] is None
    assert tool_calls.parse_tool_calls('{"name": "add", "argu', spec) == ('{"name": "add", "argu', [])
    grammar = tool_grammar(spec)
    assert grammar.matches('{"name":"add","arguments":{"a":1,"b":2}}')
    assert not grammar.matches('{"name":"now","arguments":{}}')
    assert not grammar.matches('{"name":"add","arguments":{"a":1}}')
    assert not grammar.matches('[{"name":"add","arguments":{"a":1,"b":2}}]')
    # required: an array of one or more calls of any of the tools; with parallel_tool_calls false, exactly one
    required = tool_grammar(ToolSpec(TOOLS, "required"))
    assert required.matches('[{"name":"now","arguments":{}}]')
    assert required.matches('[{"name":"add","arguments":{"a":1,"b":2}},{"name":"now","arguments":{}}]')
    assert not required.matches("[]") and not required.matches('{"name":"now","arguments":{}}')
    assert not required.matches('[{"name":"add","arguments":{}}]')
    single = tool_grammar(ToolSpec(TOOLS, "required", parallel=False))
    assert single.matches('[{"name":"now","arguments":{}}]')
    assert not single.matches('[{"name":"now","arguments":{}},{"name":"now","arguments":{}}]')
    assert parse_tools({"tools": list(TOOLS), "tool_choice": "required"}, parallel=False).call_schema()[
        "maxItems"] == 1


# ---- the stream state machine: every chunking gives the same deltas' sum, and the same as the whole answer --------
def chunkings(text):
    """The text whole, a character at a time, and split at random places (fixed seeds)."""
    yield [text]
    yield list(text)
    for seed in range(6):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed(spec, pieces):
    stream = tool_calls.ToolCallStream(spec)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return stream, deltas + stream.finish()


def check_stream(spec, text):
    """Stream ``text`` in every chunking; each time the content and every call's start and fragments add up to the
    whole answer's ``(content, calls)``, which is returned."""
    content, calls = tool_calls.parse_tool_calls(text, spec)
    for pieces in chunkings(text):
        stream, deltas = streamed(spec, pieces)
        assert all(len(d) == 1 and ("content" in d or len(d["tool_calls"]) == 1) for d in deltas), deltas
        sent = "".join(d.get("content", "") for d in deltas)
        assert (sent.strip() or None) == content if calls else sent == content, (pieces, sent)
        starts, arguments = [], {}
        for delta in deltas:
            if "tool_calls" not in delta:
                continue
            (entry,) = delta["tool_calls"]
            i = entry["index"]
            if "id" in entry:  # a call's start: once, in index order, with its name and no arguments yet
                assert i == len(starts) and entry["type"] == "function" and entry["function"]["arguments"] == ""
                assert entry["id"] == stream.calls[i].id and entry["id"].startswith("call_")
                starts.append(entry["function"]["name"])
                arguments[i] = ""
            else:  # a fragment: after its start, only arguments text
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                assert i in arguments and entry["function"]["arguments"]
                arguments[i] += entry["function"]["arguments"]
        assert starts == [c["function"]["name"] for c in calls], pieces
        assert [arguments[i] for i in range(len(calls))] == [c["function"]["arguments"] for c in calls], pieces
    return content, calls


def test_auto_stream_with_text_around_and_between_two_blocks():
    text = ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\nand '
            '<tool_call>{"name":"now","arguments":{}}</tool_call>\nDone.')
    content, calls = check_stream(AUTO, text)
    assert content == "Sure.\n\nand \nDone."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("add", '{"a": 1, "b": 2}'), ("now", "{}")]  # the arguments' text as generated


def test_auto_stream_blocks_that_are_no_call_stay_content():
    broken = 'A <tool_call>{"name": "add", "arguments" 1}</tool_call> B'
    assert check_stream(AUTO, broken) == (broken, [])
    cut_after_name = '<tool_call>{"name": "add", </tool_call>'  # the name alone does not make a call
    assert check_stream(AUTO, cut_after_name) == (cut_after_name, [])
    unknown = '<tool_call>{"name": "rm", "arguments": {"path": "/"}}</tool_call>'
    assert check_stream(AUTO, unknown) == (unknown, [])
    not_a_name = '<tool_call>{"name": ["add"], "arguments": {}}</tool_call>'
    assert check_stream(AUTO, not_a_name) == (not_a_name, [])
    content, (call,) = check_stream(AUTO, f'x {unknown} y <tool_call>{{"name": "now", "arguments": {{}}}}'
                                          "</tool_call>")
    assert content == f"x {unknown} y" and call["function"]["name"] == "now"


def test_auto_stream_readings_of_unusual_calls():
    def only_call(text):
        content, (call,) = check_stream(AUTO, text)
        assert content is None
        return call["function"]["name"], call["function"]["arguments"]

    # arguments before the name: sent once the name is known
    assert only_call('<tool_call>{"arguments": {"a": 1, "b": 2}, "name": "add"}</tool_call>') == (
        "add", '{"a": 1, "b": 2}')
    assert only_call('<tool_call>{"name": "now"}</tool_call>') == ("now", "{}")  # none: {}
    # arguments written as JSON text are sent decoded; Llama's "parameters"; the first key of each counts
    assert only_call('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>') == (
        "add", '{"a": 1, "b": 2}')
    assert only_call('<tool_call>{"name": "now", "arguments": ""}</tool_call>') == ("now", "{}")
    assert only_call('<tool_call>{"name": "now", "parameters": {"tz": "UTC"}}</tool_call>') == (
        "now", '{"tz": "UTC"}')
    assert only_call('<tool_call>{"name": "now", "arguments": {"x": 1}, "arguments": {}, "name": "add"}'
                     "</tool_call>") == ("now", '{"x": 1}')
    # a "</tool_call>" prefix inside the arguments is held back until it is not the tag; what follows the arguments
    # (a missing or extra brace) does not matter
    assert only_call('<tool_call>{"name": "now", "arguments": {"s": "a</tool b", "n": -1.5e3}}}</tool_call>') == (
        "now", '{"s": "a</tool b", "n": -1.5e3}')
    assert only_call('<tool_call>[{"name": "now", "arguments": {"n": 0}}]</tool_call>') == ("now", '{"n": 0}')
    # an output cut off inside the arguments keeps what was generated, streamed or not (OpenAI's max_tokens cut)
    assert only_call('<tool_call>{"name": "add", "arguments": {"a": 1, "b') == ("add", '{"a": 1, "b')
    assert only_call('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_') == ("add", '{"a": 1}')


def fragments(deltas):
    return [d["tool_calls"][0]["function"]["arguments"] for d in deltas]


def test_arguments_are_sent_as_they_are_generated():
    stream = tool_calls.ToolCallStream(AUTO)
    assert stream.feed('ok <tool_call>{"name": "add", "arguments": ') == [{"content": "ok "}]
    start, first = stream.feed('{"a"')  # the call starts with its arguments
    assert start["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert fragments(stream.feed(": 12")) == [": 12"]
    assert fragments(stream.feed('3, "s": "<')) == ['3, "s": "']  # "<" may start "</tool_call>"
    assert fragments(stream.feed('b"}')) == ['<b"}']
    assert stream.feed("}\n</tool_call>") == [] and stream.finish() == []
    assert stream.calls[0].arguments == '{"a": 123, "s": "<b"}'
    late = tool_calls.ToolCallStream(AUTO)  # arguments before the name go out with the call's start, not later
    assert late.feed('<tool_call>{"arguments": {"a": 1}') == []
    assert fragments(late.feed(', "name": "add"')[1:]) == ['{"a": 1}']


def test_forced_streams_send_calls_and_never_content():
    named = ToolSpec(TOOLS, "named", "add")
    text = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    content, (call,) = check_stream(named, text)
    assert content is None and call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert all("content" not in d for d in streamed(named, list(text))[1])
    # another tool's call is not the named one
    assert check_stream(named, '{"name": "now", "arguments": {}}') == ('{"name": "now", "arguments": {}}', [])
    required = ToolSpec(TOOLS, "required")
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name":"now","arguments":{"tz":"UTC"}}]'
    content, calls = check_stream(required, text)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("add", '{"a": 1, "b": 2}'), ("now", '{"tz":"UTC"}')]
    stream = tool_calls.ToolCallStream(required)
    assert fragments(stream.feed('[{"name": "add", "arguments": {"a": 1')[1:]) == ['{"a": 1']
    (second,) = stream.feed(', "b": 2}}, {"name": "now", "arguments": ')  # the first call's rest
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": ', "b": 2}'}}]}
    start, first = stream.feed("{}]")
    assert start["tool_calls"][0]["index"] == 1 and start["tool_calls"][0]["function"]["name"] == "now"
    assert fragments([first]) == ["{}"] and stream.finish() == []
    # cut off before any arguments began: no call, the text is the content
    assert check_stream(required, '[{"name": "add", "argu') == ('[{"name": "add", "argu', [])


def test_templates_without_tools_get_a_hermes_system_message():
    class NoTools:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    messages = [{"role": "user", "content": "add 1 and 2"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    out, extra = tool_calls.render_messages(messages, AUTO, NoTools())
    assert extra == {} and out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert '"name":"add"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}

    class Native:
        chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}"

    out, extra = tool_calls.render_messages(messages, AUTO, Native())
    assert extra == {"tools": list(TOOLS)} and out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


def test_tool_choice_none_offers_no_tools():
    assert parse_tools({"tools": list(TOOLS), "tool_choice": "none"}) is None
    assert parse_tools({"tools": list(TOOLS)}).choice == "auto"
