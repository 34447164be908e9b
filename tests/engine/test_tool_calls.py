"""Tool calls without a model: ``<tool_call>`` blocks parsed out of text, a stream holding them back (and a tail that
may start one), forced calls, the Hermes-style prompt for templates without tools, and the forced call grammar."""

from __future__ import annotations

import json

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


def test_stream_holds_back_calls_and_a_possible_opening_tag():
    stream = tool_calls.ToolCallStream(AUTO)
    pieces = ["Let me ", "check <to", 'ol_call>{"name": "now", ', '"arguments": {}}', "</tool_call>"]
    sent = [stream.feed(piece) for piece in pieces]
    assert sent == ["Let me ", "check ", "", "", ""]
    rest, (call,) = stream.finish()
    assert rest == "" and call["function"] == {"name": "now", "arguments": "{}"}
    plain = tool_calls.ToolCallStream(AUTO)
    assert plain.feed("a <t") == "a " and plain.feed("ip>") == "<tip>" and plain.finish() == ("", [])


def test_forced_output_is_one_call_and_its_grammar_checks_arguments():
    spec = ToolSpec(TOOLS, "named", "add")
    assert tool_calls.parse_tool_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', spec)[0] is None
    assert tool_calls.parse_tool_calls('{"name": "add", "argu', spec) == ('{"name": "add", "argu', [])
    grammar = tool_grammar(spec)
    assert grammar.matches('{"name":"add","arguments":{"a":1,"b":2}}')
    assert not grammar.matches('{"name":"now","arguments":{}}')
    assert not grammar.matches('{"name":"add","arguments":{"a":1}}')
    required = tool_grammar(ToolSpec(TOOLS, "required"))
    assert required.matches('{"name":"now","arguments":{}}') and required.matches(
        '{"name":"add","arguments":{"a":1,"b":2}}')
    stream = tool_calls.ToolCallStream(spec)
    assert stream.feed('{"name": "add", "arguments": {"a": 1, "b": 2}}') == ""
    assert stream.finish()[1][0]["function"]["name"] == "add"


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
