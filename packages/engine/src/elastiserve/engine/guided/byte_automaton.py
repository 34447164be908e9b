"""What the JSON and regex automata share: states are frozensets (``DEAD`` when empty), a start state, and a step per
byte memoised per (state, byte), so walking a token trie from a state seen before costs a dictionary lookup per
byte. A subclass sets ``_initial`` and implements ``_transition`` (the uncached step), ``accepts`` and ``is_done``."""

from __future__ import annotations

DEAD: frozenset = frozenset()
MAX_MEMO = 200_000  # (state, byte) entries kept: a bound on memory (some 40 MB) for grammars with many counting states


class ByteAutomaton:
    _initial: frozenset

    def __init__(self) -> None:
        self._memo: dict[tuple[frozenset, int], frozenset] = {}

    def start(self) -> frozenset:
        return self._initial

    def advance(self, state: frozenset, byte: int) -> frozenset:
        key = (state, byte)
        found = self._memo.get(key)
        if found is None:
            found = self._transition(state, byte) or DEAD
            if len(self._memo) > MAX_MEMO:
                self._memo.clear()
            self._memo[key] = found
        return found

    def feed(self, state: frozenset, data: bytes) -> frozenset:
        for byte in data:
            state = self.advance(state, byte)
            if not state:
                return DEAD
        return state

    def matches(self, text: str | bytes) -> bool:
        """Whether ``text`` is a whole document of this grammar (tests, and checking a finished output)."""
        data = text.encode() if isinstance(text, str) else text
        return self.accepts(self.feed(self.start(), data))

    def accepts(self, state: frozenset) -> bool:
        raise NotImplementedError

    def is_done(self, state: frozenset) -> bool:
        raise NotImplementedError

    def _transition(self, state: frozenset, byte: int) -> frozenset:
        raise NotImplementedError
