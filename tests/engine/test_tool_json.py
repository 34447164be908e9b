"""The incremental JSON scanner under the streamed tool calls: it takes exactly the texts ``json.loads`` takes (less
NaN and the infinities), reports each value's span and depth, and stops at the first character that no JSON could
have there."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastiserve.engine.tool_json import JsonScanner

pytestmark = pytest.mark.cpu

SCALARS = (st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.text()
           | st.floats(allow_nan=False, allow_infinity=False))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                         max_size=4), max_leaves=12)


def scan(text):
    scanner, events = JsonScanner(), []
    for ch in text:
        events += scanner.feed(ch)
        if scanner.failed:
            break
    return scanner, events


@settings(max_examples=300, deadline=None)
@given(VALUES, st.sampled_from([None, 0, 2]), st.booleans(), st.sampled_from([" ", "\n\t "]))
def test_any_json_value_is_taken_whole_with_the_spans_of_its_values(value, indent, ascii_only, pad):
    body = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    text = pad + body + pad  # a top-level number ends at the character after it
    scanner, events = scan(text)
    assert scanner.done and not scanner.failed, text
    opened, keys = [], []
    for event in events:  # starts and ends pair up as brackets do, each span one JSON value at its depth
        if event[0] == "start":
            assert event[1] == len(opened) and text[event[2]] == event[3]
            opened.append(event)
        elif event[0] == "end":
            start = opened.pop()
            assert start[1] == event[1]
            json.loads(text[start[2]:event[2]])
            if not opened:
                assert (start[2], event[2]) == (len(pad), len(pad) + len(body))
        else:
            keys.append(event[2])
    assert not opened

    def all_keys(v):
        if isinstance(v, dict):
            return [k for key, item in v.items() for k in (key, *all_keys(item))]
        return [k for item in v for k in all_keys(item)] if isinstance(v, list) else []

    assert keys == all_keys(value)  # decoded, in order


def test_numbers_end_at_the_next_character():
    text = '{"n": [1, -0.5e+2 ], "b": true}'
    _, events = scan(text)
    one, minus = text.index("1"), text.index("-")
    assert ("start", 2, one, "1") in events and ("end", 2, one + 1) in events
    assert ("start", 2, minus, "-") in events and ("end", 2, text.index(" ]")) in events


ALPHABET = '{}[]":,. -+0123456789eEtrufalsn\\u\nx\x01'


@st.composite
def near_json(draw):
    """A JSON text with one character inserted, removed or replaced: mostly invalid, and only just."""
    text = json.dumps(draw(VALUES), indent=draw(st.sampled_from([None, 1])))
    at = draw(st.integers(0, len(text)))
    ch = draw(st.sampled_from(ALPHABET))
    edits = [text[:at] + ch + text[at:], text[:at] + text[at + 1:], text[:at] + ch + text[at + 1:]]
    return draw(st.sampled_from(edits))


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=30) | near_json())
def test_it_takes_what_json_loads_takes_and_stops_at_the_first_bad_character(text):
    scanner, _ = scan(text + " ")
    try:
        json.loads(text)
        valid = True
    except json.JSONDecodeError:
        valid = False
    assert valid == (scanner.done and not scanner.failed), text
    if scanner.failed and scanner.pos < len(text):  # what it took could still have become JSON
        closers = "".join("}" if c == "{" else "]" for c in reversed(scanner.stack))
        assert _completes(text[:scanner.pos], closers), text


def _completes(prefix, closers):
    """Whether some text continues ``prefix`` into a JSON value: the endings a prefix of this alphabet may need, then
    the open containers closed."""
    tails = {word[i:] for word in ("true", "false", "null") for i in range(1, 5)} | {"0" * i for i in range(5)} | {"n"}
    for tail in tails:
        for quote in ("", '"', ":0", '":0', '"k":0'):
            try:
                json.loads(prefix + tail + quote + closers)
                return True
            except json.JSONDecodeError:
                pass
    return False


@pytest.mark.parametrize("text", ["00", "01", "-0", "-", "1.", ".5", "1e", "1e+", "1E-2", "0.0e0", '"\\x"', '"\\u12"',
                                  '"\\u12g4"', '"\\uD83D"', '"a\nb"', '"\\/"', "[1,]", "[,1]", '{"a":1,}', "{,}",
                                  '{"a"}', '{"a" 1}', "[1 2]", "tru", "nul", "nulll", "[]]", "{}", "[[[]]]", "-01"])
def test_edge_texts_as_json_loads_reads_them(text):
    try:
        json.loads(text)
        valid = True
    except json.JSONDecodeError:
        valid = False
    scanner, _ = scan(text + " ")
    assert valid == (scanner.done and not scanner.failed)
