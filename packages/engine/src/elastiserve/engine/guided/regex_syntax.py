"""The regex subset's parser: pattern text -> a small tree of character sets, concatenations, alternations and
bounded or unbounded repetitions, with characters as Unicode code points.

Supported: literals; ``.`` (any character but ``\\n``); classes ``[...]`` with ranges and ``^`` negation; the escapes
``\\d \\w \\s \\D \\W \\S`` (ASCII meanings, as Python's ``re.ASCII``: ``\\d`` is ``[0-9]``), ``\\n \\t \\r \\f \\v
\\0 \\a``, ``\\xHH``, ``\\uXXXX``, ``\\UXXXXXXXX`` and any escaped punctuation; groups ``( )``, ``(?: )`` and named
groups (read as plain groups: nothing is captured); ``|``; ``* + ? {m} {m,} {m,n} {,n} {,}``, each optionally lazy
(``*?``: matching is all-or-nothing here, so lazy and greedy accept the same strings); ``^`` at the start and ``$`` at
the end of a top-level alternative. Everything else (backreferences, lookaround, ``\\b``, atomic groups, possessive
quantifiers, inline flags, ``\\p{..}``) raises ``UnsupportedRegex`` naming the construct, never a silent
approximation.

Tree nodes are tuples: ``(SET, ranges)`` (sorted disjoint inclusive code-point ranges), ``(CAT, items)``,
``(ALT, items)``, ``(REPEAT, item, low, high)`` (``high`` None: unbounded).
"""

from __future__ import annotations

from elastiserve.engine.guided.schema import SchemaError

SET, CAT, ALT, REPEAT = range(4)
MAX_CODE_POINT = 0x10FFFF
MAX_REPEAT = 1000  # {m,n} bounds; each copy is a fresh NFA fragment, so this also bounds the NFA's size
Ranges = tuple[tuple[int, int], ...]


class RegexError(SchemaError):
    """A regex that is malformed (unbalanced group, bad range, nothing to repeat, too large)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "pattern")


class UnsupportedRegex(RegexError):
    """A well-formed regex construct that the automaton does not implement (named in the message)."""


def normalize(ranges) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def complement(ranges: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


DIGIT = ((0x30, 0x39),)
WORD = normalize([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = normalize([(0x09, 0x0D), (0x20, 0x20)])
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE,
                 "D": complement(DIGIT), "W": complement(WORD), "S": complement(SPACE)}
CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00, "a": 0x07}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
UNSUPPORTED_ESCAPES = {"b": "the word boundary \\b", "B": "the non-boundary \\B", "A": "the anchor \\A",
                       "Z": "the anchor \\Z", "z": "the anchor \\z", "G": "the anchor \\G",
                       "k": "the named backreference \\k", "p": "the Unicode property \\p",
                       "P": "the Unicode property \\P"}
ANY_BUT_NEWLINE = complement(((0x0A, 0x0A),))
ANYTHING = ((0, MAX_CODE_POINT),)


def literal(char: str) -> tuple:
    return (SET, ((ord(char), ord(char)),))


class Parser:
    """One pattern; ``parse()`` gives its top-level alternatives as (anchored at start, tree, anchored at end)."""

    def __init__(self, pattern: str) -> None:
        self.text = pattern
        self.pos = 0

    def parse(self) -> list[tuple[bool, tuple, bool]]:
        branches = self._alternatives(0)
        if self.pos < len(self.text):  # only a ')' stops the top level early
            raise RegexError(f"unbalanced ')' at position {self.pos}")
        return branches

    def _peek(self, offset: int = 0) -> str:
        i = self.pos + offset
        return self.text[i] if i < len(self.text) else ""

    def _alternatives(self, depth: int) -> list[tuple[bool, tuple, bool]]:
        branches = [self._branch(depth)]
        while self._peek() == "|":
            self.pos += 1
            branches.append(self._branch(depth))
        return branches

    def _branch(self, depth: int) -> tuple[bool, tuple, bool]:
        start = end = False
        if self._peek() == "^":
            if depth:
                raise UnsupportedRegex("the anchor '^' inside a group (only at the start of the pattern)")
            start = True
            self.pos += 1
        items: list[tuple] = []
        while self._peek() not in ("", "|", ")"):
            char = self._peek()
            if char == "$":
                self.pos += 1
                if depth or self._peek() not in ("", "|"):
                    raise UnsupportedRegex("the anchor '$' before the end of the pattern")
                end = True
                break
            if char == "^":
                raise UnsupportedRegex("the anchor '^' after the start of the pattern")
            items.append(self._quantified(self._atom(depth)))
        return start, items[0] if len(items) == 1 else (CAT, tuple(items)), end

    def _quantified(self, atom: tuple) -> tuple:
        bounds = self._quantifier()
        if bounds is None:
            return atom
        if self._peek() == "?":  # lazy: the same set of whole matches
            self.pos += 1
        elif self._peek() == "+":
            raise UnsupportedRegex("the possessive quantifier '+' after a quantifier")
        if self._peek() in ("*", "+", "?") or (self._peek() == "{" and self._braces() is not None):
            raise RegexError(f"multiple repeat at position {self.pos}")
        return (REPEAT, atom, *bounds)

    def _quantifier(self) -> tuple[int, int | None] | None:
        char = self._peek()
        if char in ("*", "+", "?"):
            self.pos += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        if char == "{":
            braces = self._braces()
            if braces is not None:
                self.pos, bounds = braces
                return bounds
        return None

    def _braces(self) -> tuple[int, tuple[int, int | None]] | None:
        """``{m}``, ``{m,}``, ``{m,n}``, ``{,n}`` at pos: (the position after it, bounds); None: a literal '{'."""
        close = self.text.find("}", self.pos)
        if close < 0:
            return None
        low, comma, high = self.text[self.pos + 1:close].partition(",")
        if not (low.isdigit() or comma) or (low and not low.isdigit()) or (high and not high.isdigit()):
            return None
        if not low.isascii() or not high.isascii():
            return None
        lo = int(low) if low else 0
        hi = int(high) if high else (lo if not comma else None)
        if hi is not None and hi < lo:
            raise RegexError(f"the repetition {{{low}{comma}{high}}} has its maximum below its minimum")
        if lo > MAX_REPEAT or (hi or 0) > MAX_REPEAT:
            raise RegexError(f"repetition counts above {MAX_REPEAT} are not supported")
        return close + 1, (lo, hi)

    def _atom(self, depth: int) -> tuple:
        char = self._peek()
        self.pos += 1
        if char == "(":
            return self._group(depth)
        if char == "[":
            return (SET, self._class())
        if char == ".":
            return (SET, ANY_BUT_NEWLINE)
        if char == "\\":
            return (SET, self._escape(in_class=False))
        if char in ("*", "+", "?") or (char == "{" and self._braces_at(self.pos - 1)):
            raise RegexError(f"nothing to repeat at position {self.pos - 1}")
        return literal(char)

    def _braces_at(self, pos: int) -> bool:
        saved, self.pos = self.pos, pos
        try:
            return self._braces() is not None
        finally:
            self.pos = saved

    def _group(self, depth: int) -> tuple:
        if self._peek() == "?":
            head = self.text[self.pos:self.pos + 3]
            if head.startswith("?:"):
                self.pos += 2
            elif head.startswith("?P<") or (head.startswith("?<") and head[2:3] not in ("=", "!")):
                close = self.text.find(">", self.pos)
                if close < 0:
                    raise RegexError("an unterminated group name")
                self.pos = close + 1
            else:
                names = {"?=": "the lookahead (?=", "?!": "the negative lookahead (?!", "?<": "lookbehind (?<",
                         "?P": "the named backreference (?P=", "?>": "the atomic group (?>", "?#": "comments (?#"}
                construct = names.get(head[:2], f"the inline flags or group '({head}'")
                raise UnsupportedRegex(f"{construct} is not supported")
        branches = self._alternatives(depth + 1)
        if self._peek() != ")":
            raise RegexError("a group is missing its ')'")
        self.pos += 1
        items = tuple(tree for _, tree, _ in branches)
        return items[0] if len(items) == 1 else (ALT, items)

    def _escape(self, in_class: bool) -> Ranges:
        char = self._peek()
        if not char:
            raise RegexError("the pattern ends with a lone backslash")
        self.pos += 1
        if char in CLASS_ESCAPES:
            return CLASS_ESCAPES[char]
        if char in CHAR_ESCAPES:
            return ((CHAR_ESCAPES[char],) * 2,)
        if char == "b" and in_class:  # [\b] is backspace, as in Python
            return ((0x08, 0x08),)
        if char in HEX_ESCAPES:
            digits = self.text[self.pos:self.pos + HEX_ESCAPES[char]]
            if len(digits) != HEX_ESCAPES[char] or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise RegexError(f"\\{char} needs {HEX_ESCAPES[char]} hex digits")
            self.pos += len(digits)
            value = int(digits, 16)
            if value > MAX_CODE_POINT:
                raise RegexError(f"\\{char}{digits} is not a code point")
            return ((value, value),)
        if char.isdigit():
            raise UnsupportedRegex(f"the backreference \\{char} is not supported")
        if char in UNSUPPORTED_ESCAPES:
            raise UnsupportedRegex(f"{UNSUPPORTED_ESCAPES[char]} is not supported")
        if char.isascii() and char.isalpha():
            raise RegexError(f"the escape \\{char} is unknown")
        return ((ord(char), ord(char)),)

    def _class(self) -> Ranges:
        negate = self._peek() == "^"
        if negate:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            char = self._peek()
            if not char:
                raise RegexError("a character class is missing its ']'")
            if char == "]" and not first:
                self.pos += 1
                break
            first = False
            lo = self._class_item()
            if self._peek() == "-" and self._peek(1) not in ("]", ""):
                self.pos += 1
                hi = self._class_item()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise RegexError("a class range needs a single character at each end")
                if hi[0][0] < lo[0][0]:
                    raise RegexError(f"the class range {chr(lo[0][0])!r}-{chr(hi[0][0])!r} is reversed")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        result = normalize(ranges)
        return complement(result) if negate else result

    def _class_item(self) -> Ranges:
        char = self._peek()
        self.pos += 1
        if char == "\\":
            return self._escape(in_class=True)
        return ((ord(char), ord(char)),)
