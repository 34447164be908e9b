"""Regex masks by a vectorised DFA run over the whole vocabulary at once (numpy), instead of a trie walk.

A regex state with no fast path (a digit still due in ``[0-9]``, the letters of ``[a-z]+@``) used to cost a walk of
the whole token trie in Python, one memo lookup per trie node: 16-100 ms on SmolLM2's vocabulary, paid on the host
between two decode steps. Here the tokens are a byte matrix (``TokenMatrix``) and the regex's lazily built DFA a
dense table of integer state ids (``DenseDFA``), so one position of every live token is one numpy gather:
``states = table[states, column]``. Tokens are sorted longest first, so the tokens still running at position ``i``
are a prefix of the rows; a token whose state goes ``DEAD_ID`` drops out at once, and one that ends alive is allowed
(the regex compiler prunes every NFA state that cannot reach acceptance, so a non-empty state can always complete).

The table starts empty (``UNKNOWN``) and is filled on demand: before each gather the (state, byte) pairs not seen yet
are found (``np.unique`` over the misses only) and computed once with the regex's own ``advance``, so the DFA is the
same one the trie walk uses, the trie walk stays the reference, and a warm table costs numpy work only.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

DEAD_ID = 0  # row 0 is the dead state: every byte leads back to it
UNKNOWN = -1
MAX_DENSE_STATES = 16_384  # 16 MiB of int32 rows; past it the table starts over (the regex's memo stays)


class TokenMatrix:
    """Some tokens' bytes, longest first: ``columns[i]`` holds byte ``i`` of every token (0 past a token's end),
    ``running[i]`` how many tokens (a prefix of the rows) are longer than ``i``."""

    def __init__(self, tokens: Sequence[tuple[int, bytes]]) -> None:
        tokens = sorted(tokens, key=lambda item: -len(item[1]))
        self.ids = np.array([token_id for token_id, _ in tokens], dtype=np.int64)
        longest = len(tokens[0][1]) if tokens else 0
        lengths = np.array([len(data) for _, data in tokens], dtype=np.int64)
        padded = b"".join(data.ljust(longest, b"\0") for _, data in tokens)
        rows = np.frombuffer(padded, dtype=np.uint8).reshape(len(tokens), longest)
        self.columns = np.ascontiguousarray(rows.T)  # one contiguous column per byte position
        self.running = [int(np.count_nonzero(lengths > i)) for i in range(longest + 1)]


class DenseDFA:
    """A regex's DFA as an int32 table [states, 256] of state ids, filled lazily from ``regex.advance``."""

    def __init__(self, regex) -> None:
        self.regex = regex
        self.reset()

    def reset(self) -> None:
        self.states: list[frozenset] = [frozenset()]
        self.ids: dict[frozenset, int] = {frozenset(): DEAD_ID}
        self.table = np.full((64, 256), UNKNOWN, dtype=np.int32)
        self.table[DEAD_ID] = DEAD_ID

    def id_of(self, state: frozenset) -> int:
        found = self.ids.get(state)
        if found is None:
            found = self.ids[state] = len(self.states)
            self.states.append(state)
            if found >= len(self.table):  # doubling: a few reallocations even for thousands of states
                grown = np.full((2 * len(self.table), 256), UNKNOWN, dtype=np.int32)
                grown[:len(self.table)] = self.table
                self.table = grown
        return found

    def step(self, current: np.ndarray, column: np.ndarray) -> np.ndarray:
        """The next state id of each (state id, byte) pair, computing the pairs not in the table yet."""
        nxt = self.table[current, column]
        missing = np.flatnonzero(nxt == UNKNOWN)
        if missing.size:
            pairs = np.unique(current[missing].astype(np.int64) * 256 + column[missing])
            advance, states = self.regex.advance, self.states
            for pair in pairs.tolist():
                source, byte = divmod(pair, 256)
                target = self.id_of(advance(states[source], byte))
                self.table[source, byte] = target
            nxt[missing] = self.table[current[missing], column[missing]]
        return nxt

    def row(self, source: int) -> np.ndarray:
        """Every byte's next state id from ``source``."""
        row = self.table[source]
        unknown = np.flatnonzero(row == UNKNOWN)
        if unknown.size:
            state = self.states[source]
            for byte in unknown.tolist():
                target = self.id_of(self.regex.advance(state, byte))  # may grow (replace) the table
                self.table[source, byte] = target
            row = self.table[source]
        return row

    def allowed(self, matrix: TokenMatrix, state: frozenset) -> np.ndarray:
        """The ids of the tokens in ``matrix`` whose whole bytes keep ``state`` alive."""
        if len(self.states) > MAX_DENSE_STATES:
            self.reset()
        if not state or not matrix.ids.size:
            return matrix.ids[:0]
        # The first byte: every token starts from ``state``, so its table row (256 advances at most, what the trie
        # walk's root costs) answers them all, and most tokens die here (under \d{3}-\d{4} all but those starting
        # with a digit). Gathering and uniquing every token's (state, byte) pair instead cost 6-9 ms cold there.
        row = self.row(self.id_of(state))
        current = row[matrix.columns[0]]
        rows = np.flatnonzero(current != DEAD_ID)  # the live tokens' rows, ascending
        current = current[rows]
        done: list[np.ndarray] = []
        for i, column in enumerate(matrix.columns[1:], start=1):
            still = int(np.searchsorted(rows, matrix.running[i]))  # rows >= running[i] have ended, alive
            done.append(rows[still:])
            rows, current = rows[:still], current[:still]
            if not rows.size:
                break
            current = self.step(current, column[rows])
            alive = current != DEAD_ID
            rows, current = rows[alive], current[alive]
        done.append(rows)  # the longest tokens, alive after their last byte
        return matrix.ids[np.concatenate(done)]


_dense: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # regex automaton -> its DenseDFA


def dense_dfa(regex) -> DenseDFA:
    """The regex's dense table, shared by every mask cache (it does not depend on the vocabulary) and dropped with
    the regex when its grammar leaves the grammar LRU."""
    found = _dense.get(regex)
    if found is None:
        found = _dense[regex] = DenseDFA(regex)
    return found
