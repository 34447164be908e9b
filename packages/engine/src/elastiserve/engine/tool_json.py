"""Tool calls read out of JSON text a character at a time, so that a stream can send each call as it is generated.

``JsonScanner`` checks one JSON value as it arrives and reports where values start and end (with how many containers
hold them) and each object key; a character it cannot take ends it (``failed``). Nothing is re-parsed, so feeding a
text whole or in any pieces gives the same reports.

``CallReader`` reads a call object ``{"name": ..., "arguments": {...}}`` or an array of them (what a forced
"required" choice generates) and turns each into a ``Call`` with deltas:

- A call starts (its first delta: index, id, type, name, empty arguments) once its name is known, a string naming an
  offered tool, and its arguments have begun (or its object closed without any: arguments ``{}``). Waiting for the
  arguments keeps a block that breaks right after the name (``{"name": "f", ``) from becoming a call; an unknown
  name, a name that is not a string, or JSON broken before that point give no call at all.
- The arguments are the raw text of the value (a slice of the output, no whitespace around it): every character
  the scanner takes inside it is sent at once, so the concatenated fragments are always that slice, and a complete
  value is valid JSON. The non-streaming answer reads the output the same way, hence the same string.
- A string value (a model writing the arguments as JSON text) is sent decoded when it closes, as OpenAI's
  ``arguments`` is that text (an empty one as ``{}``); it starts the call only then.
- The first ``name`` and the first of ``arguments`` / ``parameters`` (Llama's key) count; later ones are ignored,
  as is anything after the arguments. A call whose output breaks off or turns invalid inside its arguments keeps
  what was generated (as OpenAI's calls cut off by ``max_tokens`` do): nothing sent can be taken back.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WS = " \t\n\r"
VALUE, VALUE_OR_END, KEY, KEY_OR_END, COLON, AFTER, STRING, NUMBER, LITERAL = range(9)
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# number states: "-" (sign read), "zero", "int", "dot", "frac", "e", "esign", "exp"; the ones a number may end in:
NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})
NUMBER_STEPS = {("-", "0"): "zero", ("-", "d"): "int", ("zero", "."): "dot", ("zero", "e"): "e",
                ("int", "0"): "int", ("int", "d"): "int", ("int", "."): "dot", ("int", "e"): "e",
                ("dot", "0"): "frac", ("dot", "d"): "frac", ("frac", "0"): "frac", ("frac", "d"): "frac",
                ("frac", "e"): "e", ("e", "+"): "esign", ("e", "0"): "exp", ("e", "d"): "exp",
                ("esign", "0"): "exp", ("esign", "d"): "exp", ("exp", "0"): "exp", ("exp", "d"): "exp"}
ESCAPES = frozenset('"\\/bfnrtu')
HEX = frozenset("0123456789abcdefABCDEF")


def _number_class(ch: str) -> str:
    if ch == "0":
        return "0"
    if "1" <= ch <= "9":
        return "d"
    if ch in "eE":
        return "e"
    return "+" if ch in "+-" else ch


class JsonScanner:
    """One JSON value, a character at a time. ``feed`` returns the events the character completes:
    ``("start", depth, pos, char)``, ``("end", depth, end)`` (``end`` exclusive) and ``("key", depth, key)``, where
    ``depth`` counts the containers around the value (0: the top-level value) and ``pos`` the characters before."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers, "{" or "["
        self.state = VALUE
        self.pos = 0  # characters taken
        self.failed = False
        self.done = False  # the top-level value is complete
        self.key: list[str] | None = None  # an object key being read (its raw characters)
        self.escape = 0  # in a string: -1 after a backslash, n > 0 while n hex digits of a \u are due
        self.number = ""  # the number state
        self.literal = ""  # the rest of true / false / null

    def feed(self, ch: str) -> list[tuple]:
        events: list[tuple] = []
        if self.done:  # a complete value takes trailing whitespace only
            self.failed = self.failed or ch not in WS
        elif self.failed or not self._step(ch, events):
            self.failed = True
        else:
            self.pos += 1
        return events

    def _step(self, ch: str, events: list[tuple]) -> bool:
        state = self.state
        if state == STRING:
            return self._string(ch, events)
        if state == LITERAL:
            if ch != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self._end(events, self.pos + 1)
            return True
        if state == NUMBER:
            step = NUMBER_STEPS.get((self.number, _number_class(ch)))
            if step is not None:
                self.number = step
                return True
            if self.number not in NUMBER_ENDS:
                return False
            self._end(events, self.pos)  # the number ended before this character, which comes next
            if self.done:
                return ch in WS
            state = AFTER
        if ch in WS:
            return True
        if state == COLON:
            self.state = VALUE
            return ch == ":"
        if state in (KEY, KEY_OR_END):
            if ch == '"':
                self.key, self.state = [], STRING
                return True
            return ch == "}" and state == KEY_OR_END and self._close(events)
        if state == VALUE_OR_END and ch == "]":
            return self._close(events)
        if state in (VALUE, VALUE_OR_END):
            return self._start(ch, events)
        # AFTER a value inside a container (a complete top-level value takes nothing more)
        if ch == ",":
            self.state = KEY if self.stack[-1] == "{" else VALUE
            return True
        return ch == ("}" if self.stack[-1] == "{" else "]") and self._close(events)

    def _start(self, ch: str, events: list[tuple]) -> bool:
        if ch in "{[":
            self.state = KEY_OR_END if ch == "{" else VALUE_OR_END
        elif ch == '"':
            self.state = STRING
        elif ch == "-" or "0" <= ch <= "9":
            self.state, self.number = NUMBER, "-" if ch == "-" else ("zero" if ch == "0" else "int")
        elif ch in LITERALS:
            self.state, self.literal = LITERAL, LITERALS[ch]
        else:
            return False
        events.append(("start", len(self.stack), self.pos, ch))
        if ch in "{[":
            self.stack.append(ch)
        return True

    def _string(self, ch: str, events: list[tuple]) -> bool:
        if self.escape > 0:  # the hex digits of a \u
            if ch not in HEX:
                return False
            self.escape -= 1
        elif self.escape < 0:  # after a backslash
            if ch not in ESCAPES:
                return False
            self.escape = 4 if ch == "u" else 0
        elif ch == "\\":
            self.escape = -1
        elif ch == '"':
            if self.key is None:
                self._end(events, self.pos + 1)
            else:
                events.append(("key", len(self.stack), json.loads('"' + "".join(self.key) + '"')))
                self.key, self.state = None, COLON
            return True
        elif ch < " ":
            return False
        if self.key is not None:
            self.key.append(ch)
        return True

    def _close(self, events: list[tuple]) -> bool:
        self.stack.pop()
        self._end(events, self.pos + 1)
        return True

    def _end(self, events: list[tuple], end: int) -> None:
        events.append(("end", len(self.stack), end))
        self.state = AFTER
        self.done = not self.stack


@dataclass
class Call:
    """One call sent (or being sent): ``arguments`` is what its fragments have carried so far."""

    index: int
    name: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    arguments: str = ""

    def entry(self) -> dict[str, Any]:
        """Its ``message.tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class _Item:
    """A call object being read; positions index the reader's text."""

    name_start: int | None = None
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_string: bool = False  # the arguments are a JSON string (sent decoded once it closes)
    closed: bool = False
    dead: bool = False  # cannot become a call
    call: Call | None = None


class CallReader:
    """The calls of one JSON text (a ``<tool_call>`` block's body, or a forced output). Committed calls are appended
    to ``calls`` (shared by a choice's blocks, so indices run on); ``emit`` gets each delta as it is due."""

    def __init__(self, names: tuple[str, ...], calls: list[Call], emit: Callable[[dict[str, Any]], None]) -> None:
        self.names, self.calls, self.emit = names, calls, emit
        self.scanner = JsonScanner()
        self.text = ""
        self.base = 0  # the depth of a call object: 1 inside an array of calls
        self.item: _Item | None = None
        self.key: str | None = None  # the last key of the call object
        self.member = -1  # where the call object's current member value starts
        self.made = 0  # calls this text made

    def feed(self, chunk: str) -> None:
        self.text += chunk  # the scanner's positions index this text: it stops at its first bad character
        for ch in chunk:
            if self.scanner.failed or self.scanner.done:
                break
            for event in self.scanner.feed(ch):
                self._event(event)
        self._flush(self.item)

    def _event(self, event: tuple) -> None:
        kind, depth = event[0], event[1]
        if kind == "key":
            if depth == self.base + 1:
                self.key = event[2]
            return
        if kind == "start":
            ch = event[3]
            if depth == 0 and ch == "[":
                self.base = 1
            elif depth == self.base:
                self.item = _Item() if ch == "{" else None
            elif depth == self.base + 1 and self.item is not None:
                self._member_start(self.item, event[2], ch)
            return
        item = self.item
        if item is None:
            return
        if depth == self.base + 1:
            self._member_end(item, event[2])
        elif depth == self.base:
            item.closed = True
            self._commit(item)
            self.item = None

    def _member_start(self, item: _Item, pos: int, ch: str) -> None:
        self.member = pos
        if self.key == "name" and item.name_start is None:
            item.name_start = pos
        elif self.key in ("arguments", "parameters") and item.args_start is None:
            item.args_start, item.args_string = pos, ch == '"'
            self._commit(item)

    def _member_end(self, item: _Item, end: int) -> None:
        if self.member == item.name_start and item.name is None:
            name = json.loads(self.text[item.name_start:end])
            if isinstance(name, str) and name in self.names:
                item.name = name
                self._commit(item)  # arguments that came before the name go out now
            else:
                item.dead = True
        elif self.member == item.args_start and item.args_end is None:
            item.args_end = end
            self._commit(item)
            self._flush(item)

    def _commit(self, item: _Item) -> None:
        """Start the item's call if it is now certain to be one (see the module docstring)."""
        if item.call is not None or item.dead or item.name is None:
            return
        if item.args_start is None and not item.closed:
            return
        if item.args_string and item.args_end is None:
            return
        call = item.call = Call(len(self.calls), item.name)
        self.calls.append(call)
        self.made += 1
        self.emit({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": ""}}]})
        if item.args_start is None:
            self._send(call, "{}")
        elif item.args_string:
            self._send(call, json.loads(self.text[item.args_start:item.args_end]) or "{}")
        else:
            self._flush(item)

    def _flush(self, item: _Item | None) -> None:
        """Send the item's arguments as far as the scanner has taken them."""
        if item is None or item.call is None or item.args_start is None or item.args_string:
            return
        end = item.args_end if item.args_end is not None else self.scanner.pos
        self._send(item.call, self.text[item.args_start + len(item.call.arguments):end])

    def _send(self, call: Call, fragment: str) -> None:
        if fragment:
            call.arguments += fragment
            self.emit({"tool_calls": [{"index": call.index, "function": {"arguments": fragment}}]})
