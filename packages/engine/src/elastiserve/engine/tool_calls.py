"""Tool calling on chat completions: the tools into the prompt, and the model's calls out of its text.

Into the prompt: a chat template that knows tools (it reads the ``tools`` variable, as Qwen's and Llama 3's do) gets
them as ``tools=`` with the messages as they are (call arguments as objects, what those templates expect). Any other
template (SmolLM2's) gets them in the Hermes / Qwen style: a system message listing them inside ``<tools></tools>``
with the instruction to answer ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, earlier assistant calls
written back as such blocks and tool results as ``<tool_response>`` user turns.

Out of the text: with ``tool_choice`` "auto", each ``<tool_call>`` block holding a JSON call becomes one entry of
``message.tool_calls`` (id ``call_...``, ``function.arguments`` as JSON text) and the rest of the text is the
content (null when nothing is left). With a forced choice the whole output is the call's JSON (a grammar made it so).
A stream holds back text from the first ``<tool_call>`` on and sends the calls in one delta when the output ends.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def template_supports_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _system_text(tools: tuple[dict, ...]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools)
    return ("You can call functions. Their signatures are inside <tools></tools>:\n<tools>\n" + listing +
            "\n</tools>\nTo call one, answer with a JSON object of its name and arguments inside "
            "<tool_call></tool_call>:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n"
            "</tool_call>")


def _block(function: dict) -> str:
    call = {"name": function["name"], "arguments": _arguments_object(function.get("arguments", "{}"))}
    return f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}"


def render_messages(messages: list[dict], spec: Any, tokenizer: Any) -> tuple[list[dict], dict[str, Any]]:
    """The messages and extra template variables to render: ``spec`` is the request's ``ToolSpec`` (None: no tools
    offered, though the conversation may still hold earlier calls and results)."""
    native = template_supports_tools(tokenizer)
    if native:
        out = []
        for message in messages:
            if "tool_calls" in message:
                calls = [c | {"function": c["function"] | {"arguments": _arguments_object(
                    c["function"].get("arguments", "{}"))}} for c in message["tool_calls"]]
                message = message | {"tool_calls": calls}
            out.append(message)
        return out, ({"tools": list(spec.tools)} if spec is not None else {})
    out = []
    for message in messages:
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
            continue
        if "tool_calls" in message:
            blocks = "".join(_block(c["function"]) for c in message["tool_calls"])
            message = {"role": message["role"], "content": message["content"] + blocks}
        out.append({"role": message["role"], "content": message["content"]})
    if spec is not None:
        text = _system_text(spec.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}


def _call(obj: Any, names: list[str]) -> dict[str, Any] | None:
    """One OpenAI ``tool_calls`` entry from a parsed ``{"name", "arguments"}`` object (None: not a call of a tool)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": text}}


def parse_tool_calls(text: str, spec: Any) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output; no calls leaves the text as the content."""
    names = spec.names
    if spec.forced:
        try:
            call = _call(json.loads(text), names)
        except json.JSONDecodeError:
            call = None
        return (None, [call]) if call is not None else (text, [])
    calls, kept, last = [], [], 0
    for match in BLOCK.finditer(text):
        try:
            call = _call(json.loads(match.group(1)), names)
        except json.JSONDecodeError:
            call = None
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


def finish_reason(calls: list, reason: str | None) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def delta_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stream delta's ``tool_calls``: each with its index."""
    return [{"index": k} | call for k, call in enumerate(calls)]


class ToolCallStream:
    """A streamed choice's text with the tool-call blocks held back: ``feed`` returns the content that is safe to
    send now, ``finish`` the content still due and the calls."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.text = ""  # everything fed
        self.sent = 0  # characters of ``text`` sent as content
        self.in_call = spec.forced  # a forced output is one call from its first byte

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_call:
            return ""
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            self.in_call = True
            end = start
        else:  # hold back a tail that may be the start of "<tool_call>"
            end = len(self.text)
            for keep in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-keep:]):
                    end -= keep
                    break
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        _, calls = parse_tool_calls(self.text, self.spec)
        if not calls:
            return self.text[self.sent:], []
        if self.spec.forced:
            return "", calls
        remaining = BLOCK.sub("", self.text[self.sent:]) if self.in_call else self.text[self.sent:]
        return remaining.strip() and remaining, calls


def attach_calls(body: dict[str, Any], spec: Any) -> None:
    """A whole chat response's choices with their calls parsed out of their text."""
    for choice in body["choices"]:
        content, calls = parse_tool_calls(choice["message"]["content"], spec)
        if calls:
            choice["message"].update(content=content, tool_calls=calls)
            choice["finish_reason"] = finish_reason(calls, choice["finish_reason"])
