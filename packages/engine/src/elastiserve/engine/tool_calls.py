"""Tool calling on chat completions: the tools into the prompt, and the model's calls out of its text.

Into the prompt: a chat template that knows tools (it reads the ``tools`` variable, as Qwen's and Llama 3's do) gets
them as ``tools=`` with the messages as they are (call arguments as objects, what those templates expect). Any other
template (SmolLM2's) gets them in the Hermes / Qwen style: a system message listing them inside ``<tools></tools>``
with the instruction to answer ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, earlier assistant calls
written back as such blocks and tool results as ``<tool_response>`` user turns.

Out of the text (``ToolCallStream``, which reads whole answers too, so that a stream and the whole answer agree):
with ``tool_choice`` "auto", each ``<tool_call>`` block holding a JSON call (or an array of calls) becomes entries of
``message.tool_calls`` (id ``call_...``, ``function.arguments`` the raw JSON text of the arguments value) and the
rest of the text is the content (stripped; null when nothing is left). A block that is no call (broken JSON, an
unknown function) stays content. With a forced choice the whole output is the call's JSON, or for "required" an
array of calls (a grammar made it so). A stream sends content as it comes, holding back only a tail that may start
``<tool_call>`` and an open block; each call goes out as it is generated: a delta with its index, id and name once
the name is known and the arguments have begun, then the arguments' text in fragments (``tool_json`` has the rules).
"""

from __future__ import annotations

import json
from typing import Any

from elastiserve.engine.tool_json import Call, CallReader

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_supports_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON (or too deep, or past the digit limit): kept as text
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


def parse_tool_calls(text: str, spec: Any) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished output, read exactly as a stream of it would be; no calls leaves the text
    as the content."""
    stream = ToolCallStream(spec)
    stream.feed(text)
    stream.finish()
    return stream.content(), [call.entry() for call in stream.kept_calls()]


def finish_reason(calls: list, reason: str | None) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def partial_tag(text: str, start: int, tag: str) -> int:
    """How many characters at the end of ``text[start:]`` may be the start of ``tag`` (held back until known)."""
    for keep in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


class ToolCallStream:
    """A choice's output read as it is generated: ``feed`` and ``finish`` return the deltas due, each a chat chunk's
    ``delta`` body: ``{"content": ...}`` or ``{"tool_calls": [one entry]}`` (a call's start, then its arguments'
    fragments; ``tool_json`` says when each is sent). Content is held back only where it may still be a call: a tail
    that may start ``<tool_call>``, an open block (sent as content once it closes without a call), and all of a
    forced output (sent as content at the finish only if it made no call)."""

    def __init__(self, spec: Any) -> None:
        self.forced = spec.forced
        self.names = (spec.name,) if spec.name is not None else tuple(spec.names)
        self.text = ""  # everything fed
        self.calls: list[Call] = []  # every call started, in index order
        self.pos = 0  # auto: the text before it is sent as content or is a block's
        self.block = -1  # auto: where the open block's "<tool_call>" starts (-1: none is open)
        self.fed = 0  # the text before it is fed to the reader
        self.reader = CallReader(self.names, self.calls, self._emit) if spec.forced else None
        self.cuts: list[tuple[int, int]] = []  # auto: the blocks that made calls, left out of the content
        self.deltas: list[dict[str, Any]] = []
        # "auto" with parallel_tool_calls false: the first call only, as vLLM keeps it (later blocks' calls are read,
        # left out of the content and dropped); forced choices are held to it by their grammar
        self.max_calls = None if spec.forced or spec.parallel else 1

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        if self.forced:
            self._read(len(self.text))
        else:
            self._scan(final=False)
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        """The deltas due when the output has ended: the rest of the content (whitespace alone is dropped after
        calls, as the whole answer's content is stripped) and of any open block."""
        if not self.forced:
            self._scan(final=True)
        elif not self.calls:
            self._emit({"content": self.text})
        if self.calls:
            self.deltas = [d for d in self.deltas if "content" not in d or d["content"].strip()]
        return self._take()

    def content(self) -> str | None:
        """The whole answer's content once finished: the text, or (after calls) what is outside the call blocks."""
        if not self.calls:
            return self.text
        if self.forced:
            return None
        kept, last = [], 0
        for start, end in self.cuts:
            kept.append(self.text[last:start])
            last = end
        return ("".join(kept) + self.text[last:]).strip() or None

    def _scan(self, final: bool) -> None:
        text = self.text
        while True:
            if self.block < 0:
                start = text.find(OPEN, self.pos)
                if start < 0:
                    end = len(text) - (0 if final else partial_tag(text, self.pos, OPEN))
                    self._content(end)
                    return
                self._content(start)
                self.block, self.fed = start, start + len(OPEN)
                self.reader = CallReader(self.names, self.calls, self._emit)
            close = text.find(CLOSE, self.fed)
            if close < 0:
                # a tail that may start "</tool_call>" is not the call's text (at the end, most likely a cut tag)
                self._read(len(text) - partial_tag(text, self.fed, CLOSE))
                if final:
                    self._end_block(len(text))
                return
            self._read(close)
            self._end_block(close + len(CLOSE))

    def _read(self, end: int) -> None:
        if end > self.fed:
            self.reader.feed(self.text[self.fed:end])
            self.fed = end

    def _end_block(self, end: int) -> None:
        if self.reader.made:
            self.cuts.append((self.block, end))
        else:  # no call in it: its text is content after all
            self._emit({"content": self.text[self.block:end]})
        self.pos, self.block, self.reader = end, -1, None

    def _content(self, end: int) -> None:
        if end > self.pos:
            self._emit({"content": self.text[self.pos:end]})
            self.pos = end

    def kept_calls(self) -> list[Call]:
        """The calls the answer carries (all of them, or the first under ``max_calls``)."""
        return self.calls if self.max_calls is None else self.calls[:self.max_calls]

    def _emit(self, delta: dict[str, Any]) -> None:
        """Queue a delta, merged into the one before when both are content or fragments of the same call."""
        if self.max_calls is not None and "tool_calls" in delta and delta["tool_calls"][0]["index"] >= self.max_calls:
            return
        last = self.deltas[-1] if self.deltas else None
        if last is not None and "content" in delta and "content" in last:
            last["content"] += delta["content"]
            return
        if last is not None and "tool_calls" in delta and "tool_calls" in last:
            new, old = delta["tool_calls"][0], last["tool_calls"][0]
            if "id" not in new and "id" not in old and new["index"] == old["index"]:
                old["function"]["arguments"] += new["function"]["arguments"]
                return
        self.deltas.append(delta)

    def _take(self) -> list[dict[str, Any]]:
        out, self.deltas = self.deltas, []
        return out


def attach_calls(body: dict[str, Any], spec: Any) -> None:
    """A whole chat response's choices with their calls parsed out of their text."""
    for choice in body["choices"]:
        if choice["message"]["content"] is None:  # all reasoning (engine.reasoning): no answer to read calls from
            continue
        content, calls = parse_tool_calls(choice["message"]["content"], spec)
        if calls:
            choice["message"].update(content=content, tool_calls=calls)
            choice["finish_reason"] = finish_reason(calls, choice["finish_reason"])
