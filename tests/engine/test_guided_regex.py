"""The regex automaton (``guided_regex``, JSON Schema ``pattern``) without a model: whole-match results equal Python's
``re.fullmatch`` (``re.ASCII``: ``\\d`` is ``[0-9]``) on hand-picked and exhaustively enumerated strings, UTF-8
included; every prefix of a match is alive and a string that no match starts with is dead; ``is_done`` only when no
byte can follow; unsupported constructs raise naming them; masks (the plain-token fast path included) equal a
brute-force check of every token of a small vocabulary and of SmolLM2's, and the vectorised DFA run's masks equal the
trie walk's (the reference) on both; ``pattern`` strings search as ECMA does."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from elastiserve.engine.guided.grammar import json_schema_grammar, regex_grammar
from elastiserve.engine.guided.masks import MaskCache, TokenTable, string_room
from elastiserve.engine.guided.regex import RegexError, UnsupportedRegex, compile_regex, utf8_runs
from elastiserve.engine.guided.schema import SchemaError, UnsupportedSchema

pytestmark = pytest.mark.cpu

CASES = [  # (pattern, matching strings, strings no match starts with)
    (r"\d{3}-\d{4}", ["123-4567"], ["12a", "1234", "123-45678"]),
    (r"[a-z]+@[a-z]+\.com", ["ab@cd.com", "a@b.com"], ["@", "a@.", "A", "a@b.comx"]),
    ("(yes|no)", ["yes", "no"], ["yn", "nope", "yess"]),
    (".*", ["", "abc", "é😀 x", "\t"], ["\n", "a\nb"]),
    ("^a(?:b|c)*d?$", ["a", "abcbd", "ad"], ["b", "ada", "abd "]),
    ("x{2,}y{,2}", ["xx", "xxxxy", "xxyy"], ["y", "xy", "xxyyy"]),
    ("x{2}|y{1,3}", ["xx", "y", "yyy"], ["xxx", "yyyy", "xy"]),
    ("[à-é]+ñ?", ["é", "àéñ"], ["e", "ñ", "éññ"]),
    (r"\u00e9\.\x41", ["é.A"], ["e", "é.a"]),
    (r"[^a-c\n]+", ["dé😀", "🙂", " ", "\t"], ["a", "d\n"]),
    (r"\w+\s\W\S", ["ab_9 !x", "a\t.."], [" ", "a!", "é"]),
    (r"\D\d", ["a1", "é2", "\n3"], ["1", "aa"]),
    ("[]a-]+", ["]", "a-]"], ["b"]),
    (r"(?P<year>\d{4})-(?P<month>0[1-9]|1[0-2])", ["2024-01", "1999-12"], ["2024-13", "2024-00", "202-"]),
    ("a+?b*?c??", ["a", "aabbc"], ["b", "abcc"]),
    ("a{3}b{0}c", ["aaac"], ["aaab", "aaaa"]),
    (r"\{\}|\[x]|a{,}|b{1,2", ["{}", "[x]", "", "aa", "b{1,2"], ["{x", "[]", "b{1,3"]),
    ("😀|日本語?", ["😀", "日本", "日本語"], ["日語", "😁"]),
    ("(a|ab)(c|bcd)(d*)", ["abcd", "abcdd", "ac"], ["abd", "b"]),
    ("", [""], ["a"]),
]


@pytest.mark.parametrize(("pattern", "good", "dead"), CASES)
def test_whole_matches_equal_re_fullmatch_and_prefixes_live_or_die(pattern, good, dead):
    automaton = compile_regex(pattern)
    for text in good:
        assert re.fullmatch(pattern, text, re.ASCII), (pattern, text)  # the case itself is right
        assert automaton.matches(text), (pattern, text)
        data = text.encode()
        for end in range(len(data)):  # every byte prefix of a match is alive, mid-character ones included
            assert automaton.feed(automaton.start(), data[:end]), (pattern, data[:end])
    for text in dead:
        assert not automaton.feed(automaton.start(), text.encode()), (pattern, text)
    alphabet = sorted({c for t in good + dead for c in t} | {"a", "1", "\n"})[:7]
    for size in range(4):  # every short string over the cases' characters: the same answer as re
        for chars in itertools.product(alphabet, repeat=size):
            text = "".join(chars)
            assert automaton.matches(text) == bool(re.fullmatch(pattern, text, re.ASCII)), (pattern, text)


def test_dot_and_negated_classes_read_only_well_formed_utf8():
    automaton = compile_regex("[^a]")
    for char in ["\x00", "\x7f", "\x80", "\u07ff", "\u0800", "\ud7ff", "\ue000", "\uffff", "\U00010000",
                 "\U0010ffff"]:
        assert automaton.matches(char), repr(char)
    for data in [b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80",
                 b"\xf5", b"\x80", b"\xc3(", b"a"]:
        assert not automaton.matches(data), data  # overlong, surrogate, beyond U+10FFFF, stray continuation
    total = sum(_run_size(run) for run in utf8_runs(0, 0x10FFFF))
    assert total == 0x110000 - 0x800  # the runs cover every code point but the surrogates, each once


def _run_size(run):
    size = 1
    for lo, hi in run:
        size *= hi - lo + 1
    return size


def test_accepts_and_is_done():
    automaton = compile_regex("(yes|no)|a+")
    assert automaton.is_done(automaton.feed(automaton.start(), b"yes"))
    after_a = automaton.feed(automaton.start(), b"a")
    assert automaton.accepts(after_a) and not automaton.is_done(after_a)  # more a's may follow
    anything = compile_regex(".*")
    assert anything.accepts(anything.start()) and not anything.is_done(anything.feed(anything.start(), b"x"))
    bounded = compile_regex("a{2,3}")
    assert not bounded.is_done(bounded.feed(bounded.start(), b"aa"))
    assert bounded.is_done(bounded.feed(bounded.start(), b"aaa"))
    assert compile_regex("(?<word>ab)+").matches("abab")  # ECMA's named group, a plain group here
    empty_branch = compile_regex("a[^\\s\\S]|b")  # the dead branch is pruned: 'a' dies at once
    assert not empty_branch.feed(empty_branch.start(), b"a") and empty_branch.matches("b")


@pytest.mark.parametrize(("pattern", "construct"), [
    (r"(a)\1", "backreference"), ("(?P<x>a)(?P=x)", "backreference"), (r"(?<x>a)\k<x>", "backreference"),
    ("(?=a)a", "lookahead"), ("(?!a)b", "negative lookahead"), ("(?<=a)b", "lookbehind"), ("(?<!a)b", "lookbehind"),
    (r"\bword", "word boundary"), ("a*+", "possessive"), ("a{2}+", "possessive"), ("(?i)a", "flags"),
    ("(?>a)", "atomic"), ("a^b", "'^'"), ("a$b", "'$'"), ("(^a)", "'^'"), (r"\p{L}", "Unicode property"),
    (r"a\Z", "anchor"),
])
def test_unsupported_constructs_raise_naming_them(pattern, construct):
    with pytest.raises(UnsupportedRegex) as info:
        compile_regex(pattern)
    assert construct in str(info.value) and isinstance(info.value, SchemaError)


@pytest.mark.parametrize("pattern", ["(a", "a)", "*a", "a**", "[a", "[z-a]", r"\x1", "\\", r"\q", "a{3,1}",
                                     "a{1001}", "[^\\s\\S]"])
def test_malformed_regexes_raise(pattern):
    with pytest.raises(RegexError):
        regex_grammar(pattern)


# Tokens that cross a regex's pieces, partial UTF-8 (é is C3 A9, 😀 F0 9F 98 80), quotes, backslashes, newlines.
VOCAB = [b"1", b"12", b"123", b"-", b"3-4", b"a", b"ab", b"@", b"b@c", b".com", b".", b"com", b"yes", b"y", b"no",
         b"n", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xf0\x9f", b"\x98\x80", b"\xf0\x9f\x98\x80", b"\n", b"\t", b'"', b'a"',
         b'1"}', b"\\", b"\\n", b" ", b"x y", b"{", b'{"id":"', b'"}', b"}"]
EOS = len(VOCAB)


def brute_force(automaton, state):
    allowed = {i for i, data in enumerate(VOCAB) if automaton.feed(state, data)}
    return allowed | ({EOS} if automaton.accepts(state) else set())


@pytest.mark.parametrize(("grammar", "text"), [
    (lambda: regex_grammar(r"\d{3}-\d{4}"), "123-4567"),
    (lambda: regex_grammar(r"[a-z]+@[a-z]+\.com"), "ab@c.com"),
    (lambda: regex_grammar("(yes|no)"), "no"),
    (lambda: regex_grammar(".*"), "é😀 a\tb"),
    (lambda: regex_grammar('[^"]*x'), 'a\n\\é x'),
    (lambda: json_schema_grammar({"type": "object", "properties": {"id": {"type": "string", "pattern": "[0-9]"}},
                                  "required": ["id"]}), '{"id":"aé1 b"}'),
])
def test_masks_equal_a_brute_force_check_of_every_token(grammar, text):
    grammar = grammar()
    table = TokenTable([*VOCAB, None], eos_ids=[EOS])
    cache = MaskCache(table)
    automaton, state = grammar.automaton, grammar.automaton.start()
    for byte in [None, *text.encode()]:  # the mask before each byte of a valid output
        if byte is not None:
            state = automaton.advance(state, byte)
        mask = cache.mask(grammar, state)
        assert {i for i, bit in enumerate(mask) if bit} == brute_force(automaton, state), (text, state)
    assert automaton.accepts(state)


def test_the_fast_path_applies_where_plain_characters_loop():
    dot = regex_grammar(".*").automaton
    assert string_room(dot.start(), dot) == float("inf")
    assert string_room(dot.feed(dot.start(), b"\xc3"), dot) is None  # mid-character
    phone = regex_grammar(r"\d{3}").automaton
    assert string_room(phone.start(), phone) is None
    found = json_schema_grammar({"type": "string", "pattern": "[0-9]"}).automaton
    assert string_room(found.feed(found.start(), b'"a'), found) is None  # a digit would change the state
    assert string_room(found.feed(found.start(), b'"a1'), found) == float("inf")
    plain = json_schema_grammar({"type": "string"}).automaton
    assert plain.feed(plain.start(), b'"ab') == frozenset({((3, 0, None, 0, 0, 0), None)})  # the hot key as before


PATTERN_SCHEMA = {"type": "object", "properties": {"id": {"type": "string", "pattern": "[0-9]"}}, "required": ["id"]}
# Regex states without the fast path (the vectorised run) and with it, reached after a few bytes: UTF-8 classes,
# mid-character states, pattern frames before and after their match, two pattern frames (or a pattern and a plain
# string) in one state, and regexes whose DFA has many states (2**10 for the last a/b one).
VECTORISED_CASES = [
    (lambda: regex_grammar(r"\d{3}-\d{4}"), "123-4567"),
    (lambda: regex_grammar(r"[a-z]+@[a-z]+\.com"), "ab@c.com"),
    (lambda: regex_grammar(".*"), "é😀 a\tb"),
    (lambda: regex_grammar("[à-é]+ñ?|[^a-c\n]{2}"), "àéñ"),
    (lambda: regex_grammar("😀|日本語?"), "日本語"),
    (lambda: regex_grammar("(a|b)*a(a|b){9}"), "abababababab"),
    (lambda: regex_grammar("[a-z ]{1,40}x"), "ab cd eex"),
    (lambda: json_schema_grammar(PATTERN_SCHEMA), '{"id":"aé1 b"}'),
    (lambda: json_schema_grammar({"type": "string", "pattern": "^[a-zé]{2,5}@$"}), '"aéb@"'),
    (lambda: json_schema_grammar({"anyOf": [{"type": "string", "pattern": "^a+1"}, {"type": "string",
                                                                                   "pattern": "^a*b"}]}), '"aab"'),
    (lambda: json_schema_grammar({"anyOf": [{"type": "string", "pattern": "^a+1"}, {"type": "string",
                                                                                   "maxLength": 3}]}), '"aa1"'),
]


def assert_vectorised_equals_the_walk(table, grammar, state):
    vectorised, reference = MaskCache(table), MaskCache(table, vectorised=False)
    assert vectorised.mask(grammar, state) == reference.mask(grammar, state), state


@pytest.mark.parametrize(("grammar", "text"), VECTORISED_CASES)
def test_vectorised_masks_equal_the_trie_walk(grammar, text):
    grammar = grammar()
    table = TokenTable([*VOCAB, b"b", b"ba", b"aab", b"aaa", b"1", None, None], eos_ids=[EOS + 5])
    automaton, state = grammar.automaton, grammar.automaton.start()
    for byte in [None, *text.encode()]:  # before each byte of a valid output, mid-character states included
        if byte is not None:
            state = automaton.advance(state, byte)
        assert_vectorised_equals_the_walk(table, grammar, state)
    assert automaton.accepts(state)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's vocabulary bytes and its token table (built once for this module's SmolLM2 tests)."""
    from elastiserve.engine.guided.vocab import vocabulary_bytes
    from elastiserve.engine.loader import smollm2_dir
    from elastiserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir())
    vocab = vocabulary_bytes(tokenizer, tokenizer.vocab_size)
    return vocab, TokenTable(vocab, tokenizer.eos_token_ids)


def test_smollm2_vectorised_masks_equal_the_trie_walk(smollm2):
    _, table = smollm2
    searched = json_schema_grammar(PATTERN_SCHEMA)
    for grammar, prefix in [
        (regex_grammar(r"\d{3}-\d{4}"), b""), (regex_grammar(r"\d{3}-\d{4}"), b"12"),
        (regex_grammar(r"[a-z]+@[a-z]+\.com"), b"ab"), (regex_grammar(r"[a-z]+@[a-z]+\.com"), b"ab@c"),
        (regex_grammar(".*"), b"\xc3"), (regex_grammar("[^\\n]*é[^\\n]{3}"), b"x\xc3\xa9a"),
        (regex_grammar("[a-z ]{1,64}\\."), b"a"), (regex_grammar("(a|b)*a(a|b){9}"), b"ab"),
        (searched, b'{"id":"a'), (searched, b'{"id":"a1'), (searched, b'{"id":"\xe6\x97'),
    ]:
        state = grammar.automaton.feed(grammar.automaton.start(), prefix)
        assert state, prefix
        assert_vectorised_equals_the_walk(table, grammar, state)


def test_smollm2_regex_masks_equal_brute_force(smollm2):
    vocab, table = smollm2
    cache = MaskCache(table)
    searched = json_schema_grammar({"type": "string", "pattern": "[0-9]"})
    for grammar, prefix in [(regex_grammar(".*"), b"ab"), (regex_grammar(r"[a-z]+@[a-z]+\.com"), b"ab@c"),
                            (searched, b'"a1'), (searched, b'"a')]:
        state = grammar.automaton.feed(grammar.automaton.start(), prefix)
        mask = cache.mask(grammar, state)
        expected = {i for i, data in enumerate(vocab) if data and i not in table.eos_ids
                    and grammar.automaton.feed(state, data)}
        assert {i for i, bit in enumerate(mask) if bit and i not in table.eos_ids} == expected, prefix


# ---- JSON Schema pattern ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("pattern", "texts"), [
    ("^[a-z]+$", ["abc", "", "ab1", "é"]),
    ("[0-9]", ["a1b", "ab", "1", "", "é9"]),
    ("^ab", ["abc", "cab", "ab"]),
    ("c$", ["abc", "cab", "c"]),
    ("^a|b$", ["ax", "xb", "xa", "bx"]),
    ("^(\\d{3}-)?\\d{4}$", ["555-1234", "1234", "55-1234"]),
    ("é.😀", ["xéa😀y", "é😀"]),
])
def test_pattern_strings_search_as_ecma_does(pattern, texts):
    grammar = json_schema_grammar({"type": "string", "pattern": pattern})
    for text in texts:
        document = json.dumps(text, ensure_ascii=False)
        assert grammar.matches(document) == bool(re.search(pattern, text, re.ASCII)), (pattern, text)


def test_pattern_strings_have_no_escapes_and_combine_with_the_rest():
    schema = {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                               "note": {"pattern": "x"},
                                               "code": {"enum": ["ab", "a1", 3], "pattern": "^a\\d"}},
              "required": ["zip"]}
    grammar = json_schema_grammar(schema)
    assert grammar.matches('{"zip":"12345","note":"axb","code":"a1"}')
    assert grammar.matches('{"zip":"12345","code":3}')
    assert not grammar.matches('{"zip":"1234"}') and not grammar.matches('{"zip":"12345","code":"ab"}')
    assert not grammar.matches('{"zip":"12345","note":"\\u0078"}')  # x, but escaped: not read
    assert not json_schema_grammar({"type": "string", "pattern": "."}).matches('"\\n"')
    union = json_schema_grammar({"anyOf": [{"type": "string", "pattern": "^a+$"}, {"type": "string", "pattern": "^b"}]})
    assert union.matches('"aa"') and union.matches('"bz"') and not union.matches('"ab"')


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "string", "pattern": "a", "maxLength": 3}, "maxLength"),
    ({"type": "string", "pattern": '^"$'}, "escapes"),
    ({"type": "string", "pattern": "(?=a)"}, "lookahead"),
    ({"type": "string", "pattern": 3}, "string"),
    ({"enum": ["b"], "pattern": "a"}, "matches"),
])
def test_bad_patterns_raise(schema, words):
    with pytest.raises(SchemaError) as info:
        json_schema_grammar(schema)
    assert words in str(info.value) and info.value.keyword == "pattern"
    if words in ("maxLength", "escapes"):
        assert isinstance(info.value, UnsupportedSchema)
