"""Token masks: which vocabulary tokens keep a grammar's automaton alive, and the per-request ``Guide``.

``TokenTable`` holds the vocabulary's bytes as a trie. A mask is computed by walking the trie depth first with the
automaton, pruning a subtree as soon as its prefix kills every configuration; a token is allowed when the walk
reaches its node alive. EOS is allowed only where the document may end.

The hot state is the inside of a string: a plain byte (printable, not ``"`` or ``\\``, complete UTF-8) only
advances its character count, whatever the stack beneath, so a token made of plain bytes only (48,464 of SmolLM2's
49,152) is allowed there exactly when it fits the string's room (any length without ``maxLength``): those masks are
precomputed per vocabulary (per room when bounded). Only the other tokens (the "special" trie: quotes, backslashes,
control bytes, partial UTF-8; 670 in SmolLM2) are walked, and those do depend on the stack (``"}`` closes the
string and then an object). Every mask is cached by (grammar, state), a state being the whole configuration set, in
an LRU shared by all requests of one engine.

Measured on SmolLM2's vocabulary (49,152 tokens) on this project's 2-core CPU (AMD EPYC, Python 3.11), with
``python -m elastiserve.engine.guided.bench``: the table 0.8-1.0 s (0.13 s of it the byte matrices), once per
engine. A cache miss with a cold transition memo: after ``{`` of json_object 0.5-0.8 ms (136 tokens allowed), after
``:`` (any value) 1.1-1.9 ms, inside a free string 0.5-0.8 ms (48,786 allowed), inside a declared key 0.2-0.4 ms,
inside an integer 0.5-0.8 ms, inside a maxLength-12 string 3.0 ms (the first time that room is seen); with a warm
memo 0.05-0.25 ms; a cache hit 0.2-0.4 us. Walking the whole trie inside a string costs 68-78 ms instead, which is
why the plain part is precomputed. Feeding a sampled token to its guide: 4-25 us with a cold memo. The sampler's
side, masking 4 rows of CPU logits: 0.45 ms.

Regex states (``guided_regex``; a ``pattern`` string's frame) take the same fast path when every plain character
leads back to the same state (``RegexAutomaton.plain_invariant``, proved on one byte per byte class and memoised per
state): ``.*``, a searched ``pattern`` once found. Other regex states are judged by a vectorised run of the regex's
DFA over the vocabulary's byte matrix (``vector_masks``): every token of a ``guided_regex``; for a ``pattern``
frame the plain tokens only (they stay inside the string, so the regex alone judges them), while the special trie
is still walked with the whole automaton (a quote may close the string). ``vectorised=False`` keeps the trie walk:
the reference. On the same machine, a cache miss (first miss with a cold DFA table; warm table), trie walk ->
vectorised: ``[a-z]+@[a-z]+\\.com`` after ``ab`` 14-21 ms -> 5.1-5.6 ms (0.5-0.8 ms warm; 11,639 tokens allowed),
after ``ab@c`` 15-22 ms -> 1.0-1.4 ms; a ``pattern: "[0-9]"`` string before its digit 66-84 ms -> 3.9-6.6 ms (2.6-3.7
warm); ``[^\\n]*é[^\\n]{3}`` after ``x`` 65-99 ms -> 4.5-6.4 ms (2.6-2.7 warm); ``[a-z ]{1,64}\\.`` after ``a`` (a
state per count) 49-50 ms -> 7.2-10.5 ms (2.1-3.2 warm). States that the first byte prunes to a few tokens cost a
little more than the walk: ``\\d{3}-\\d{4}`` at the start 0.10-0.13 ms -> 0.5-0.7 ms (0.1 ms warm), ``(yes|no)``
0.15-0.19 ms -> 0.6-1.0 ms. The fast path as before: ``.*`` 0.2-1.1 ms, a found ``pattern`` 0.8-1.9 ms. The LRU is
shared by every request of an engine, so each of these is paid once per state, not per token.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from elastiserve.engine.errors import InvalidRequest
from elastiserve.engine.guided.automaton import PATTERN, STRING
from elastiserve.engine.guided.byte_automaton import DEAD
from elastiserve.engine.guided.grammar import Grammar
from elastiserve.engine.guided.regex import RegexAutomaton
from elastiserve.engine.guided.vector_masks import TokenMatrix, dense_dfa


def is_plain(data: bytes) -> bool:
    """Bytes that leave an unconstrained string's state unchanged: no quote, backslash or control byte, and whole
    UTF-8 characters."""
    if b'"' in data or b"\\" in data or any(b < 0x20 for b in data):
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class _Trie:
    __slots__ = ("children", "ids")

    def __init__(self) -> None:
        self.children: dict[int, _Trie] = {}
        self.ids: list[int] = []

    def insert(self, data: bytes, token_id: int) -> None:
        node = self
        for byte in data:
            child = node.children.get(byte)
            if child is None:
                child = node.children[byte] = _Trie()
            node = child
        node.ids.append(token_id)


class TokenTable:
    """The vocabulary's bytes, its tries, the plain-string mask, and the byte matrices of all tokens and of the plain
    ones (``vector_masks``: regex states). ``token_bytes[i]`` None: never allowed (special tokens, padding ids)."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos_ids: Iterable[int]) -> None:
        self.token_bytes = list(token_bytes)
        self.size = len(self.token_bytes)
        self.eos_ids = tuple(sorted(i for i in set(eos_ids) if 0 <= i < self.size))
        if not self.eos_ids:
            raise InvalidRequest("guided decoding needs an EOS token id")
        self.trie = _Trie()
        self.special_trie = _Trie()
        plain = bytearray(self.size)
        self.plain_lengths: dict[int, int] = {}  # plain token -> its characters
        for token_id, data in enumerate(self.token_bytes):
            if not data or token_id in self.eos_ids:
                continue
            self.trie.insert(data, token_id)
            if is_plain(data):
                plain[token_id] = 1
                self.plain_lengths[token_id] = len(data.decode())
            else:
                self.special_trie.insert(data, token_id)
        self.plain_mask = plain
        self.longest_plain = max(self.plain_lengths.values(), default=0)
        self._plain_upto: dict[int, bytearray] = {}
        # Built here, once per engine, so that no request's first regex mask pays for them.
        self.vocab_matrix = TokenMatrix([(i, data) for i, data in enumerate(self.token_bytes)
                                         if data and i not in self.eos_ids])
        self.plain_matrix = TokenMatrix([(i, self.token_bytes[i]) for i in self.plain_lengths])

    def plain_upto(self, room: float) -> bytearray:
        """The plain tokens of at most ``room`` characters (a string with a maxLength)."""
        if room >= self.longest_plain:
            return self.plain_mask
        room = int(room)
        mask = self._plain_upto.get(room)
        if mask is None:
            mask = self._plain_upto[room] = bytearray(self.size)
            for token_id, length in self.plain_lengths.items():
                if length <= room:
                    mask[token_id] = 1
        return mask


def walk(trie: _Trie, automaton, state: frozenset) -> list[int]:
    """The token ids under ``trie`` whose bytes keep ``state`` alive."""
    advance = automaton.advance
    allowed: list[int] = []
    stack = [(trie, state)]
    while stack:
        node, current = stack.pop()
        for byte, child in node.children.items():
            nxt = advance(current, byte)
            if nxt:
                if child.ids:
                    allowed.extend(child.ids)
                if child.children:
                    stack.append((child, nxt))
    return allowed


def string_room(state: frozenset, automaton=None) -> float | None:
    """When every configuration is inside a string between characters (no escape or UTF-8 sequence open): the most
    characters a plain token may add (inf without maxLength); None otherwise. A plain token only advances a
    string's character count, whatever the stack beneath, so it is allowed exactly when it fits this room. A
    ``pattern`` string, or a regex automaton's state, counts as unbounded room when every plain character leads
    back to the same state (``plain_invariant``: ``.*``, a searched pattern once found); other regex states get
    no fast path (None)."""
    room = -1.0
    for config in state:
        if type(config) is not tuple:  # a regex automaton's NFA state ids
            return math.inf if automaton is not None and automaton.plain_invariant(state) else None
        frame = config[0] if config else None
        if frame is None:
            return None
        if frame[0] == STRING and not frame[4] and not frame[5]:
            room = max(room, math.inf if frame[2] is None else frame[2] - frame[3])
        elif frame[0] == PATTERN and automaton is not None and \
                automaton.nodes[frame[1]].regex.plain_invariant(frame[2]):
            room = math.inf
        else:
            return None
    return room


def pattern_plan(state: frozenset, automaton) -> tuple[float, dict] | None:
    """When every configuration is inside a string between characters, some of them ``pattern`` strings whose
    regex state has no fast path: the plain tokens' room from the other strings (-1: none) and, per regex, the union
    of its states (an NFA state set, so one run judges every configuration of that regex); None otherwise."""
    room, regex_states = -1.0, {}
    for config in state:
        frame = config[0] if config else None
        if frame is None:
            return None
        if frame[0] == STRING and not frame[4] and not frame[5]:
            room = max(room, math.inf if frame[2] is None else frame[2] - frame[3])
        elif frame[0] == PATTERN:
            regex = automaton.nodes[frame[1]].regex
            if regex.plain_invariant(frame[2]):
                room = math.inf
            else:
                regex_states[regex] = regex_states.get(regex, DEAD) | frame[2]
        else:
            return None
    return room, regex_states


class MaskCache:
    """Masks (``bytearray`` of 0/1 per token id, what the sampler reads) by (grammar, state), least recently used
    dropped past ``capacity`` (a SmolLM2 mask is 48 KiB: 512 of them are 24 MiB). ``vectorised=False`` judges regex
    states by the trie walk alone: the reference the tests hold the vectorised masks to."""

    def __init__(self, table: TokenTable, capacity: int = 512, vectorised: bool = True) -> None:
        self.table = table
        self.capacity = capacity
        self.vectorised = vectorised
        self._masks: OrderedDict[tuple[Grammar, frozenset], bytearray] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def mask(self, grammar: Grammar, state: frozenset) -> bytearray:
        key = (grammar, state)
        found = self._masks.get(key)
        if found is not None:
            self._masks.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        found = self.compute(grammar, state)
        self._masks[key] = found
        if len(self._masks) > self.capacity:
            self._masks.popitem(last=False)
        return found

    def compute(self, grammar: Grammar, state: frozenset) -> bytearray:
        table, automaton = self.table, grammar.automaton
        room = string_room(state, automaton)
        if room is not None:
            mask = bytearray(table.plain_upto(room))
            allowed = walk(table.special_trie, automaton, state)
        elif self.vectorised and (found := self._vectorised(automaton, state)) is not None:
            mask, allowed = found
        else:
            mask = bytearray(table.size)
            allowed = walk(table.trie, automaton, state)
        for token_id in allowed:
            mask[token_id] = 1
        if automaton.accepts(state):
            for token_id in table.eos_ids:
                mask[token_id] = 1
        return mask

    def _vectorised(self, automaton, state: frozenset) -> tuple[bytearray, list[int]] | None:
        """A regex state's mask by a vectorised DFA run (``vector_masks``), and the tokens still to set; None where
        it does not apply (a JSON state outside strings)."""
        table = self.table
        if isinstance(automaton, RegexAutomaton):
            mask = bytearray(table.size)
            np.frombuffer(mask, dtype=np.uint8)[dense_dfa(automaton).allowed(table.vocab_matrix, state)] = 1
            return mask, []
        plan = pattern_plan(state, automaton)
        if plan is None:
            return None
        room, regex_states = plan
        mask = bytearray(table.plain_upto(room)) if room >= 0 else bytearray(table.size)
        bits = np.frombuffer(mask, dtype=np.uint8)
        for regex, regex_state in regex_states.items():  # plain tokens stay inside the string: the regex judges them
            bits[dense_dfa(regex).allowed(table.plain_matrix, regex_state)] = 1
        del bits  # the bytearray stays resizable for its readers
        # The others may close the string (a quote: the regex must accept there), so the full automaton walks them.
        return mask, walk(table.special_trie, automaton, state)


class Guide:
    """One request's (one candidate's) position in its grammar: a function of the tokens it has generated, so
    preemption by recompute keeps it as it is."""

    def __init__(self, grammar: Grammar, cache: MaskCache) -> None:
        self.grammar = grammar
        self.cache = cache
        self.state = grammar.automaton.start()

    def allowed(self) -> bytearray:
        return self.cache.mask(self.grammar, self.state)

    def advance(self, token_id: int) -> bool:
        """Take a sampled token; False when it breaks the grammar (the guide is then dead). EOS is not fed."""
        if token_id in self.cache.table.eos_ids:
            return self.accepts
        data = self.cache.table.token_bytes[token_id] if 0 <= token_id < self.cache.table.size else None
        self.state = self.grammar.automaton.feed(self.state, data) if data else DEAD
        return bool(self.state)

    @property
    def accepts(self) -> bool:
        return self.grammar.automaton.accepts(self.state)

    @property
    def done(self) -> bool:
        """Complete, and nothing but EOS may follow."""
        return self.grammar.automaton.is_done(self.state)

    @property
    def dead(self) -> bool:
        return not self.state

