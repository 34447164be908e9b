"""A pushdown automaton over the UTF-8 bytes of a JSON document, driven by the compiled schema nodes.

JSON's structure is ASCII, so each structural character is one byte; inside strings non-ASCII characters are
checked as well-formed UTF-8 byte by byte (lead byte, then its continuation bytes in the ranges UTF-8 allows). Working
on bytes is what lets a byte-level BPE token that ends (or starts) in the middle of a character be judged exactly:
it is alive when its bytes keep the automaton alive, which can only happen inside a string.

A configuration is a stack of frames as a linked tuple ``(frame, parent)`` (``parent`` None at the bottom), and
``END`` once the top-level value is complete (nothing may follow: no trailing whitespace). A state is a frozenset of
configurations: ``anyOf`` and object keys that could be declared or additional are followed in parallel, so no
branch is picked before the bytes decide. Frames are flat tuples that start with a tag:

- ``(VALUE, node, ws)``: before a value; ``ws`` whitespace bytes read here so far.
- ``(OBJECT, node, phase, index, ws, current)``: ``index`` is the first declared property not yet passed,
  ``current`` the property whose key or value is being read (``EXTRA``: an additional one).
- ``(ARRAY, node, phase, count, ws)``: ``count`` items so far (capped at ``minItems`` when there is no maximum).
- ``(STRING, min, max, count, escape, utf8)``: inside a string; ``count`` characters (kept 0 when unbounded, so the
  unconstrained string's state never changes: the hot state of every mask cache).
- ``(PATTERN, node, regex_state)``: inside a string constrained by a ``pattern``; ``regex_state`` is the node's
  regex automaton's state over the raw bytes read since the opening quote (a separate frame, so the plain
  ``STRING`` frame and its mask fast path stay as they were; a pattern string has no escapes, see ``schema``).
- ``(NUMBER, integer, phase, digits)``, ``(LITERAL, options, pos)``: the options still matching after ``pos`` bytes.

Whitespace is allowed at each structural position but at most ``max_whitespace`` bytes there, so a model cannot
spin on spaces forever; digits are bounded too (``MAX_DIGITS`` in the integer and fraction parts).
"""

from __future__ import annotations

from elastiserve.engine.guided.byte_automaton import ByteAutomaton
from elastiserve.engine.guided.schema import (
    ArrayNode,
    Node,
    NumberNode,
    ObjectNode,
    PatternNode,
    StringNode,
    UnionNode,
)

VALUE, OBJECT, ARRAY, STRING, NUMBER, LITERAL, PATTERN = range(7)
END: tuple = ()
EXTRA = -1
# OBJECT phases
KEY_OR_CLOSE, KEY, IN_KEY, COLON, IN_VALUE, AFTER_VALUE = range(6)
# ARRAY phases
FIRST, IN_ITEM, AFTER_ITEM = range(3)
# NUMBER phases
START, MINUS, ZERO, INT, DOT, FRAC, EXP, EXP_SIGN, EXP_DIGITS = range(9)
NUMBER_DONE = frozenset({ZERO, INT, FRAC, EXP_DIGITS})
MAX_DIGITS = 16
MAX_EXP_DIGITS = 3
WHITESPACE = frozenset(b" \t\n\r")
ESCAPES = frozenset(b'"\\/bfnrt')
HEX = frozenset(b"0123456789abcdefABCDEF")
FREE_KEY = (STRING, 0, None, 0, 0, 0)  # an additional property's key


def _utf8_lead(byte: int) -> tuple[int, int, int] | None:
    """(continuation bytes still due, lowest and highest allowed next byte) after a lead byte; None if invalid."""
    if 0xC2 <= byte <= 0xDF:
        return 1, 0x80, 0xBF
    if byte == 0xE0:
        return 2, 0xA0, 0xBF
    if 0xE1 <= byte <= 0xEF:
        return 2, 0x80, 0x9F if byte == 0xED else 0xBF  # ED A0..BF would encode a surrogate
    if byte == 0xF0:
        return 3, 0x90, 0xBF
    if 0xF1 <= byte <= 0xF3:
        return 3, 0x80, 0xBF
    if byte == 0xF4:
        return 3, 0x80, 0x8F
    return None


class JsonAutomaton(ByteAutomaton):
    """``start()`` gives the initial state, ``advance(state, byte)`` the next one (``DEAD`` when no configuration
    survives), memoised (``ByteAutomaton``)."""

    def __init__(self, nodes: list[Node], root: int, max_whitespace: int = 8) -> None:
        self.nodes = nodes
        self.root = root
        self.max_whitespace = max_whitespace
        super().__init__()
        # No whitespace before the document: its first byte is the value's (and guided_choice's texts are exact).
        self._initial = frozenset({((VALUE, root, max_whitespace), None)})

    def _transition(self, state: frozenset, byte: int) -> frozenset:
        out: set = set()
        for config in state:
            self._step(config, byte, out)
        return frozenset(out)

    def accepts(self, state: frozenset) -> bool:
        """The document may end here (EOS is allowed)."""
        return any(self._accepts(config) for config in state)

    def is_done(self, state: frozenset) -> bool:
        """The document is complete and nothing may follow: only EOS remains."""
        return bool(state) and all(config == END for config in state)

    def _accepts(self, config: tuple) -> bool:
        if config == END:
            return True
        frame, parent = config
        return frame[0] == NUMBER and frame[2] in NUMBER_DONE and parent is None

    # ---- one configuration, one byte -------------------------------------------------------------------------
    def _step(self, config: tuple, byte: int, out: set) -> None:
        if config == END:
            return
        frame, parent = config
        tag = frame[0]
        if tag == STRING:
            self._string(frame, parent, byte, out)
        elif tag == VALUE:
            if byte in WHITESPACE:
                if frame[2] < self.max_whitespace:
                    out.add(((VALUE, frame[1], frame[2] + 1), parent))
                return
            self._start_value(frame[1], byte, parent, out)
        elif tag == OBJECT:
            self._object(frame, parent, byte, out)
        elif tag == ARRAY:
            self._array(frame, parent, byte, out)
        elif tag == NUMBER:
            self._number(frame, parent, byte, out)
        elif tag == PATTERN:
            self._pattern(frame, parent, byte, out)
        else:
            self._literal(frame[1], frame[2], parent, byte, out)

    def _start_value(self, index: int, byte: int, parent: tuple | None, out: set) -> None:
        node = self.nodes[index]
        if isinstance(node, UnionNode):
            for option in node.options:
                self._start_value(option, byte, parent, out)
        elif isinstance(node, StringNode):
            if byte == 0x22:
                out.add(((STRING, node.min_length, node.max_length, 0, 0, 0), parent))
        elif isinstance(node, ObjectNode):
            if byte == 0x7B:
                out.add(((OBJECT, index, KEY_OR_CLOSE, 0, 0, EXTRA), parent))
        elif isinstance(node, ArrayNode):
            if byte == 0x5B:
                out.add(((ARRAY, index, FIRST, 0, 0), parent))
        elif isinstance(node, NumberNode):
            self._number((NUMBER, node.integer, START, 0), parent, byte, out)
        elif isinstance(node, PatternNode):
            if byte == 0x22:
                out.add(((PATTERN, index, node.regex.start()), parent))
        else:
            self._literal(node.options, 0, parent, byte, out)

    def completed(self, parent: tuple | None) -> tuple:
        """The configuration once the value (or key) on top of ``parent`` is complete."""
        if parent is None:
            return END
        frame, grand = parent
        if frame[0] == OBJECT:
            phase = COLON if frame[2] == IN_KEY else AFTER_VALUE
            return (OBJECT, frame[1], phase, frame[3], 0, frame[5] if phase == COLON else EXTRA), grand
        return (ARRAY, frame[1], AFTER_ITEM, frame[3], 0), grand

    def _literal(self, options: tuple[bytes, ...], pos: int, parent: tuple | None, byte: int, out: set) -> None:
        matching = [o for o in options if o[pos] == byte]
        if not matching:
            return
        if any(len(o) == pos + 1 for o in matching):
            out.add(self.completed(parent))
        rest = tuple(o for o in matching if len(o) > pos + 1)
        if rest:
            out.add(((LITERAL, rest, pos + 1), parent))

    def _string(self, frame: tuple, parent: tuple | None, byte: int, out: set) -> None:
        _, low, high, count, escape, utf8 = frame
        if utf8:
            due, lo, hi = utf8
            if lo <= byte <= hi:
                out.add(((STRING, low, high, count, 0, (due - 1, 0x80, 0xBF) if due > 1 else 0), parent))
            return
        if escape == 1:
            if byte in ESCAPES:
                out.add(((STRING, low, high, count, 0, 0), parent))
            elif byte == 0x75:  # \u: four hex digits follow
                out.add(((STRING, low, high, count, 5, 0), parent))
            return
        if escape:
            if byte in HEX:
                out.add(((STRING, low, high, count, escape - 1 if escape > 2 else 0, 0), parent))
            return
        if byte == 0x22:
            if count >= low:
                out.add(self.completed(parent))
            return
        if byte < 0x20:  # control characters must be escaped
            return
        lead = None
        if byte >= 0x80:
            lead = _utf8_lead(byte)
            if lead is None:
                return
        if high is not None:
            if count >= high:
                return
            count += 1
        elif count < low:
            count += 1
        out.add(((STRING, low, high, count, 1 if byte == 0x5C else 0, lead or 0), parent))

    def _pattern(self, frame: tuple, parent: tuple | None, byte: int, out: set) -> None:
        regex = self.nodes[frame[1]].regex
        if byte == 0x22:
            if regex.accepts(frame[2]):
                out.add(self.completed(parent))
            return
        state = regex.advance(frame[2], byte)  # the quote, backslash and control bytes have no edges here
        if state:
            out.add(((PATTERN, frame[1], state), parent))

    def _object(self, frame: tuple, parent: tuple | None, byte: int, out: set) -> None:
        _, index, phase, next_prop, ws, current = frame
        node: ObjectNode = self.nodes[index]
        if byte in WHITESPACE:
            if ws < self.max_whitespace:
                out.add(((OBJECT, index, phase, next_prop, ws + 1, current), parent))
            return
        if phase in (KEY_OR_CLOSE, KEY):
            if byte == 0x22:
                for j in node.candidates(next_prop):
                    holder = ((OBJECT, index, IN_KEY, next_prop, 0, j), parent)
                    out.add(((LITERAL, (node.properties[j][0],), 0), holder))
                if node.extra is not None and node.may_close(next_prop):
                    out.add((FREE_KEY, ((OBJECT, index, IN_KEY, len(node.properties), 0, EXTRA), parent)))
            elif byte == 0x7D and phase == KEY_OR_CLOSE and node.may_close(next_prop):
                out.add(self.completed(parent))
        elif phase == COLON:
            if byte == 0x3A:
                if current == EXTRA:
                    child, after = node.extra, len(node.properties)
                else:
                    child, after = node.properties[current][1], current + 1
                out.add(((VALUE, child, 0), ((OBJECT, index, IN_VALUE, after, 0, EXTRA), parent)))
        elif phase == AFTER_VALUE:
            if byte == 0x2C:
                more = next_prop < len(node.properties) or (node.extra is not None and node.may_close(next_prop))
                if more:
                    out.add(((OBJECT, index, KEY, next_prop, 0, EXTRA), parent))
            elif byte == 0x7D and node.may_close(next_prop):
                out.add(self.completed(parent))

    def _array(self, frame: tuple, parent: tuple | None, byte: int, out: set) -> None:
        _, index, phase, count, ws = frame
        node: ArrayNode = self.nodes[index]
        if byte in WHITESPACE:
            if ws < self.max_whitespace:
                out.add(((ARRAY, index, phase, count, ws + 1), parent))
            return
        if byte == 0x5D:
            if count >= node.min_items:
                out.add(self.completed(parent))
            return
        if phase == FIRST:
            if node.max_items != 0:
                self._start_value(node.items, byte, ((ARRAY, index, IN_ITEM, self._count(node, 1), 0), parent), out)
        elif phase == AFTER_ITEM and byte == 0x2C and (node.max_items is None or count < node.max_items):
            holder = ((ARRAY, index, IN_ITEM, self._count(node, count + 1), 0), parent)
            out.add(((VALUE, node.items, 0), holder))

    @staticmethod
    def _count(node: ArrayNode, count: int) -> int:
        # Without a maximum only "at least minItems yet?" matters: capping keeps long arrays' states identical.
        return count if node.max_items is not None else min(count, node.min_items)

    def _number(self, frame: tuple, parent: tuple | None, byte: int, out: set) -> None:
        _, integer, phase, digits = frame
        digit = 0x30 <= byte <= 0x39
        nxt = None
        if phase == START:
            nxt = (MINUS, 0) if byte == 0x2D else (ZERO, 0) if byte == 0x30 else (INT, 1) if digit else None
        elif phase == MINUS:
            nxt = (ZERO, 0) if byte == 0x30 else (INT, 1) if digit else None
        elif phase in (ZERO, INT, FRAC) and not integer and byte in (0x65, 0x45):
            nxt = (EXP, 0)
        elif phase in (ZERO, INT) and not integer and byte == 0x2E:
            nxt = (DOT, 0)
        elif phase in (INT, FRAC) and digit and digits < MAX_DIGITS:
            nxt = (phase, digits + 1)
        elif phase == DOT:
            nxt = (FRAC, 1) if digit else None
        elif phase == EXP:
            nxt = (EXP_SIGN, 0) if byte in (0x2B, 0x2D) else (EXP_DIGITS, 1) if digit else None
        elif phase == EXP_SIGN:
            nxt = (EXP_DIGITS, 1) if digit else None
        elif phase == EXP_DIGITS and digit and digits < MAX_EXP_DIGITS:
            nxt = (EXP_DIGITS, digits + 1)
        if nxt is not None:
            out.add(((NUMBER, integer, *nxt), parent))
        elif phase in NUMBER_DONE:  # the byte ends the number: the parent reads it
            self._step(self.completed(parent), byte, out)
