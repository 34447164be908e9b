"""Regexes (a practical subset, parsed by ``regex_syntax``) as automata over UTF-8 bytes, for ``guided_regex`` and
JSON Schema's ``pattern``.

Thompson construction: each tree node becomes an NFA fragment over bytes. A character set becomes the UTF-8
encodings of its code-point ranges, split into runs whose every byte is a plain range (``U+0080-U+07FF`` is
``[C2-DF][80-BF]``; ``U+0800-U+FFFF`` splits around ``E0`` and the surrogates' ``ED A0-BF``), so ``.`` and negated
classes accept exactly the well-formed UTF-8 characters outside the set, one to four bytes, and a token that ends
mid-character is judged exactly. Then the compiler drops every state that cannot reach the accepting one (an empty
class, or bytes excluded by the caller: a JSON string's quote, backslash and control bytes), so every live state can
still complete: ``is_done`` (accepting, no byte continues) is exact and a mask never leads into a dead end.

A state is a frozenset of NFA state ids, closed under the epsilon edges (closures precomputed, keeping only states
with byte edges or the accepting one, so equivalent sets compare equal); ``advance(state, byte)`` is memoised per
(state, byte), which amounts to a DFA built lazily. Matching is whole-string (``re.fullmatch``): ``^`` and ``$`` are
accepted where they say nothing more. ``search=True`` (JSON Schema's ECMA semantics) puts any text before a branch
that is not ``^``-anchored and after one that is not ``$``-anchored.
"""

from __future__ import annotations

from elastiserve.engine.guided.byte_automaton import DEAD, ByteAutomaton
from elastiserve.engine.guided.regex_syntax import (
    ALT,
    ANYTHING,
    CAT,
    REPEAT,
    SET,
    Parser,
    RegexError,
    UnsupportedRegex,
    complement,
    normalize,
)

__all__ = ["RegexAutomaton", "RegexError", "UnsupportedRegex", "compile_regex"]

MAX_STATES = 20_000  # some 10 MB of Python lists; {m,n} copies its fragment, so large bounds meet this first
MAX_PATTERN = 4096
SURROGATES = (0xD800, 0xDFFF)
UTF8_LENGTH_ENDS = (0x7F, 0x7FF, 0xFFFF, 0x10FFFF)
# The characters of ``masks.is_plain`` tokens: all but the quote, the backslash and control characters.
PLAIN_CHARS = complement(normalize([(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]))
MAX_INVARIANCE_PROBES = 4096  # byte steps spent proving a state plain-invariant; `.*` needs 25


def _encode(code_point: int) -> bytes:
    return chr(code_point).encode("utf-8", "surrogatepass")


def utf8_runs(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The code points lo..hi (surrogates left out) as runs of byte ranges: each run is one byte range per byte
    position, and the runs' byte strings together are exactly those code points' UTF-8 encodings."""
    if lo <= SURROGATES[1] and hi >= SURROGATES[0]:
        runs = []
        if lo < SURROGATES[0]:
            runs += utf8_runs(lo, SURROGATES[0] - 1)
        if hi > SURROGATES[1]:
            runs += utf8_runs(SURROGATES[1] + 1, hi)
        return runs
    for end in UTF8_LENGTH_ENDS[:-1]:  # one encoded length per run
        if lo <= end < hi:
            return utf8_runs(lo, end) + utf8_runs(end + 1, hi)
    size = len(_encode(lo))
    for i in range(1, size):  # the trailing i bytes must span all of 80-BF, or the range is split there
        mask = (1 << (6 * i)) - 1
        if lo & ~mask != hi & ~mask:
            if lo & mask:
                return utf8_runs(lo, lo | mask) + utf8_runs((lo | mask) + 1, hi)
            if hi & mask != mask:
                return utf8_runs(lo, (hi & ~mask) - 1) + utf8_runs(hi & ~mask, hi)
    first, last = _encode(lo), _encode(hi)
    return [[(first[k], last[k]) for k in range(size)]]


def _without(lo: int, hi: int, excluded: frozenset[int]) -> list[tuple[int, int]]:
    out, start = [], lo
    for byte in range(lo, hi + 1):
        if byte in excluded:
            if start < byte:
                out.append((start, byte - 1))
            start = byte + 1
    if start <= hi:
        out.append((start, hi))
    return out


class _Builder:
    """The NFA under construction: per state its byte edges ``(lo, hi, target)`` and epsilon edges."""

    def __init__(self, excluded: frozenset[int]) -> None:
        self.edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []
        self.excluded = excluded

    def state(self) -> int:
        if len(self.edges) >= MAX_STATES:
            raise RegexError(f"the regex compiles to more than {MAX_STATES} states; use smaller repetition counts")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def byte_edge(self, source: int, lo: int, hi: int, target: int) -> None:
        pieces = _without(lo, hi, self.excluded) if self.excluded and lo < 0x80 else [(lo, hi)]
        self.edges[source].extend((a, b, target) for a, b in pieces)

    def fragment(self, tree: tuple) -> tuple[int, int]:
        kind = tree[0]
        if kind == SET:
            return self._set(tree[1])
        if kind == CAT:
            start = end = self.state()
            for item in tree[1]:
                first, last = self.fragment(item)
                self.eps[end].append(first)
                end = last
            return start, end
        if kind == ALT:
            start, end = self.state(), self.state()
            for item in tree[1]:
                first, last = self.fragment(item)
                self.eps[start].append(first)
                self.eps[last].append(end)
            return start, end
        assert kind == REPEAT
        _, item, low, high = tree
        start = end = self.state()
        for _ in range(low):
            first, last = self.fragment(item)
            self.eps[end].append(first)
            end = last
        if high is None:  # a loop: item* after the required copies
            loop = self.state()
            first, last = self.fragment(item)
            self.eps[end].append(loop)
            self.eps[loop].append(first)
            self.eps[last].append(loop)
            return start, loop
        final = self.state()
        for _ in range(high - low):  # each optional copy may be skipped straight to the end
            first, last = self.fragment(item)
            self.eps[end] += [first, final]
            end = last
        self.eps[end].append(final)
        return start, final

    def _set(self, ranges) -> tuple[int, int]:
        start, end = self.state(), self.state()
        prefixes: dict[tuple, int] = {}  # runs sharing leading byte ranges share their states (``.``: 13 states)
        for lo, hi in ranges:
            for run in utf8_runs(lo, hi):
                source = start
                for k in range(len(run) - 1):
                    key = tuple(run[:k + 1])
                    if key not in prefixes:
                        prefixes[key] = self.state()
                        self.byte_edge(source, *run[k], prefixes[key])
                    source = prefixes[key]
                self.byte_edge(source, *run[-1], end)
        return start, end


class RegexAutomaton(ByteAutomaton):
    """The interface of ``JsonAutomaton``: ``start``, ``advance``, ``feed``, ``matches``, ``accepts``, ``is_done``."""

    def __init__(self, pattern: str, search: bool = False, excluded: frozenset[int] = frozenset()) -> None:
        if not isinstance(pattern, str):
            raise RegexError("a regex must be a string")
        if len(pattern) > MAX_PATTERN:
            raise RegexError(f"the regex is over {MAX_PATTERN} characters")
        super().__init__()
        self.pattern = pattern
        branches = []
        for anchored_start, tree, anchored_end in Parser(pattern).parse():
            if search:
                anything = (REPEAT, (SET, ANYTHING), 0, None)
                tree = (CAT, (*(() if anchored_start else (anything,)), tree,
                              *(() if anchored_end else (anything,))))
            branches.append(tree)
        builder = _Builder(excluded)
        start, self.accept = builder.fragment(branches[0] if len(branches) == 1 else (ALT, tuple(branches)))
        self._edges = self._prune(builder.edges, builder.eps)
        self._closures = self._close(builder.eps)
        self._initial = self._closures[start]
        # Bytes where some edge's range starts or ends: bytes between two cuts act alike in every NFA state.
        self._cuts = sorted({b for out in self._edges for lo, hi, _ in out for b in (lo, hi + 1)})
        self._invariant: dict[frozenset, bool] = {}

    def _prune(self, edges: list, eps: list) -> list[tuple[tuple[int, int, int], ...]]:
        """Byte edges into states that cannot reach the accepting one are dropped."""
        back: list[list[int]] = [[] for _ in edges]
        for source, targets in enumerate(eps):
            for target in targets:
                back[target].append(source)
        for source, out in enumerate(edges):
            for _, _, target in out:
                back[target].append(source)
        self._live = live = {self.accept}
        stack = [self.accept]
        while stack:
            for source in back[stack.pop()]:
                if source not in live:
                    live.add(source)
                    stack.append(source)
        return [tuple(e for e in out if e[2] in live) if source in live else () for source, out in enumerate(edges)]

    def _close(self, eps: list) -> list[frozenset]:
        keep = [bool(out) or s == self.accept for s, out in enumerate(self._edges)]
        closures = []
        for state in range(len(eps)):
            seen, stack = {state}, [state]
            while stack:
                for target in eps[stack.pop()]:
                    if target not in seen and target in self._live:
                        seen.add(target)
                        stack.append(target)
            closures.append(frozenset(s for s in seen if keep[s]) if state in self._live else DEAD)
        return closures

    def _transition(self, state: frozenset, byte: int) -> frozenset:
        out: set[int] = set()
        for source in state:
            for lo, hi, target in self._edges[source]:
                if lo <= byte <= hi:
                    out |= self._closures[target]
        return frozenset(out)

    def accepts(self, state: frozenset) -> bool:
        return self.accept in state

    def is_done(self, state: frozenset) -> bool:
        """Accepting and no byte continues (every kept state but the accepting one has a live byte edge)."""
        return state == {self.accept}

    def plain_invariant(self, state: frozenset) -> bool:
        """Whether every plain character (``PLAIN_CHARS``) leads from ``state`` back to it (``.*``, ``[^"]*``, a
        searched pattern once matched): then a plain token is allowed there whatever its length, which is the masks'
        fast path. Proved on one byte per class of bytes that no edge tells apart, so a few dozen steps."""
        found = self._invariant.get(state)
        if found is None:
            budget = [MAX_INVARIANCE_PROBES]
            found = bool(state) and all(self._run_returns(state, state, run, budget)
                                        for lo, hi in PLAIN_CHARS for run in utf8_runs(lo, hi))
            self._invariant[state] = found
        return found

    def _run_returns(self, target: frozenset, current: frozenset, run: list, budget: list[int]) -> bool:
        if not run:
            return current == target
        lo, hi = run[0]
        for byte in [lo, *(c for c in self._cuts if lo < c <= hi)]:
            budget[0] -= 1
            if budget[0] < 0:
                return False
            nxt = self.advance(current, byte)
            if not nxt or not self._run_returns(target, nxt, run[1:], budget):
                return False
        return True

    @property
    def can_match(self) -> bool:
        return bool(self._initial)


def compile_regex(pattern: str, search: bool = False, excluded: frozenset[int] = frozenset()) -> RegexAutomaton:
    return RegexAutomaton(pattern, search, excluded)
