"""Guided decoding without a model: the JSON automaton accepts and rejects hand-written documents for each schema
feature (every prefix of a valid document alive, a wrong byte dead), schema errors name their keyword, masks equal a
brute-force check of every token of a small vocabulary (partial UTF-8 tokens and tokens that cross structure
included) and of SmolLM2's, and the sampler's allowed-token masks constrain greedy and sampled rows."""

from __future__ import annotations

import pytest
import torch

from elastiserve.engine.guided.grammar import choice_grammar, json_object_grammar, json_schema_grammar
from elastiserve.engine.guided.masks import Guide, MaskCache, TokenTable
from elastiserve.engine.guided.schema import SchemaError, UnsupportedSchema
from elastiserve.engine.sampler import Sampler
from elastiserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.cpu

PERSON = {
    "type": "object",
    "title": "a person",  # descriptive keywords are ignored
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8, "description": "given name"},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 2},
        "pet": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/pet"}]},
        "ok": {"type": "boolean"},
        "kind": {"const": "human"},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
    "$defs": {"pet": {"type": "object", "properties": {"species": {"enum": ["cat", "dog"]}},
                      "required": ["species"]}},
}

CASES = [  # (schema or "object" / choices list, accepted documents, rejected documents)
    ("object", ['{}', '{"a":1}', '{"a": [1, -2.5e+3, "x\\u00e9\\n", true, null, {}]}', '{ "é😀" : "ü" }',
                '{"a":{"b":[[],{}]}}', '{"a":0.5E-1}'],
     ['', '[1]', '"x"', '{"a":01}', '{"a":1,}', '{"a":.5}', '{"a":"\x01"}', '{"a":"\\x"}', '{a:1}', '{} ',
      '{"a":tru}', '{"a":1}}']),
    (PERSON, ['{"name":"Bo","tags":["a"]}', '{"name":"Bo","age":-3,"height":1.8,"tags":["a",3],"pet":null,'
              '"ok":true,"kind":"human"}', '{"name":"Bo","tags":["b"],"pet":{"species":"dog"}}',
              '{ "name" : "Bo" , "tags" : [ "a" ] }'],
     ['{"tags":["a"],"name":"Bo"}',  # declared order
      '{"name":"Bo"}', '{"name":"","tags":["a"]}', '{"name":"Bobbybobb","tags":["a"]}', '{"name":"Bo","tags":[]}',
      '{"name":"Bo","tags":["a","b","a"]}', '{"name":"Bo","tags":["c"]}', '{"name":"Bo","age":1.5,"tags":["a"]}',
      '{"name":"Bo","tags":["a"],"x":1}', '{"name":"Bo","tags":["a"],"pet":{}}', '{"name":"Bo","tags":["a"],'
      '"kind":"cat"}', '{"name":"Bo","tags":["a"],"ok":1}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     ['{}', '{"a":1}', '{"a":1,"b":"x","c":"y"}', '{"z":"x"}'], ['{"a":1,"b":2}', '{"b":"x","a":1,"c":1}']),
    ({"type": ["string", "null"], "maxLength": 2}, ['"ab"', 'null', '"é😀"'], ['"abc"', '1', '']),
    ({"type": "array", "items": {"type": "integer"}}, ['[]', '[1,2,3]', '[ 1 , 2 ]'], ['[1,]', '[,1]', '["1"]']),
    ({"oneOf": [{"type": "integer"}, {"type": "object", "properties": {"x": {"type": "boolean"}}}]},
     ['12', '-0', '{"x":false}', '{}'], ['1.5', '{"x":1}', '01']),
    ({"enum": [1, 12, "x", [1, {"a": None}]]}, ['1', '12', '"x"', '[1,{"a":null}]'], ['123', '2', '"y"']),
    ({"type": "string"}, ['""', '"a\\"b"', '"\\ud83d\\ude00"'],
     ['"', '"\\u12g4"', 'a', b'"\xc3"', b'"\xc3\x28"', b'"\xed\xa0\x80"']),  # broken UTF-8 too
    (["Paris", "Lyon", "Paris-Nord"], ['Paris', 'Lyon', 'Paris-Nord'], ['paris', ' Paris', 'Paris ', '"Paris"']),
]


def grammar_of(spec):
    if spec == "object":
        return json_object_grammar()
    if isinstance(spec, list):
        return choice_grammar(spec)
    return json_schema_grammar(spec)


@pytest.mark.parametrize(("spec", "good", "bad"), CASES)
def test_automaton_accepts_valid_documents_and_every_prefix_is_alive(spec, good, bad):
    automaton = grammar_of(spec).automaton
    for text in good:
        assert automaton.matches(text), text
        data, state = text.encode(), automaton.start()
        for i, byte in enumerate(data):
            state = automaton.advance(state, byte)
            assert state, f"{text!r} died at byte {i}"
            assert i == len(data) - 1 or not automaton.is_done(state)
    for text in bad:
        assert not automaton.matches(text), text


def test_a_wrong_byte_kills_the_state_and_done_means_only_eos():
    automaton = json_schema_grammar(PERSON).automaton
    state = automaton.feed(automaton.start(), b'{"name":"Bo","tags":["a"]')
    assert state and not automaton.accepts(state)
    for wrong in b'x]:"1 '[:-1]:
        assert not automaton.advance(state, wrong), chr(wrong)
    state = automaton.advance(state, ord("}"))
    assert automaton.accepts(state) and automaton.is_done(state)
    number = json_schema_grammar({"type": "integer"}).automaton
    state = number.feed(number.start(), b"12")
    assert number.accepts(state) and not number.is_done(state)  # more digits may follow
    assert not number.feed(number.start(), b"1" * 17)  # digits are bounded


def test_whitespace_is_bounded():
    automaton = json_object_grammar().automaton
    assert automaton.matches("{" + " " * 8 + "}")
    assert not automaton.matches("{" + " " * 9 + "}")
    assert not automaton.matches(' {}')  # the document starts with its value


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "string", "pattern": "a+", "minLength": 1}, "pattern"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}, "format"),
    ({"type": "integer", "minimum": 0}, "minimum"),
    ({"allOf": [{"type": "integer"}]}, "allOf"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
    ({"type": "object", "properties": {}, "required": ["x"]}, "required"),
])
def test_unsupported_keywords_raise_naming_the_keyword(schema, keyword):
    with pytest.raises(UnsupportedSchema) as info:
        json_schema_grammar(schema)
    assert info.value.keyword == keyword and keyword in str(info.value)


@pytest.mark.parametrize("schema", [{"type": "strange"}, {"type": "array", "maxItems": -1},
                                    {"$ref": "#/$defs/missing"}, {"anyOf": []},
                                    {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
                                     "$ref": "#/$defs/a"}])
def test_malformed_schemas_raise(schema):
    with pytest.raises(SchemaError):
        json_schema_grammar(schema)


def test_recursive_refs_through_objects_compile():
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array",
                                                                         "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    assert json_schema_grammar(tree).matches('{"kids":[{"kids":[]},{}]}')


# A small vocabulary with tokens that cross structure (`"}`, `",`), whitespace runs, escapes, numbers, and partial
# UTF-8 (é is C3 A9, 😀 is F0 9F 98 80).
SMALL_VOCAB = [b"{", b"}", b'"', b'"}', b'",', b'":', b":", b",", b" ", b"\n  ", b"[", b"]", b"a", b"name", b'"name',
               b'name"', b"Bo", b"\\", b'\\"', b"\\u00e9", b"1", b"12", b"-", b".", b"e", b"true", b"null", b"\xc3",
               b"\xa9", b"\xc3\xa9", b"\xf0\x9f", b"\x98\x80", b'"tags":["a"]}', b"human", b"\x01", b"x", b"ab"]
EOS = len(SMALL_VOCAB)


def brute_force(automaton, state, vocab):
    allowed = {i for i, data in enumerate(vocab) if data is not None and automaton.feed(state, data)}
    if automaton.accepts(state):
        allowed.add(EOS)
    return allowed


@pytest.mark.parametrize(("spec", "document"), [
    ("object", '{"name": "B\\"oé😀", "x": [1, -2.5e3, true, null, {}],\n  "y": {}}'),
    (PERSON, '{"name":"Boé","age":12,"tags":["a",3],"pet":{"species":"cat"},"kind":"human"}'),
    (["Paris", "Lyon"], "Paris"),
])
def test_masks_equal_a_brute_force_check_of_every_token(spec, document):
    grammar = grammar_of(spec)
    table = TokenTable([*SMALL_VOCAB, None, None], eos_ids=[EOS])  # id EOS: the EOS token; the last: padding
    cache = MaskCache(table)
    automaton, state = grammar.automaton, grammar.automaton.start()
    for byte in [None, *document.encode()]:  # the mask before each byte of a valid document
        if byte is not None:
            state = automaton.advance(state, byte)
        mask = cache.mask(grammar, state)
        assert {i for i, bit in enumerate(mask) if bit} == brute_force(automaton, state, SMALL_VOCAB), state
    assert automaton.is_done(state)


def test_smollm2_masks_equal_brute_force_and_tokens_decode_to_their_bytes():
    from elastiserve.engine.guided.vocab import vocabulary_bytes
    from elastiserve.engine.loader import smollm2_dir
    from elastiserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir())
    vocab = vocabulary_bytes(tokenizer, tokenizer.vocab_size)
    for token_id in range(17, len(vocab), 97):  # the bytes are what the detokenizer emits
        text = tokenizer.decode([token_id])
        if "\ufffd" not in text:
            assert vocab[token_id].decode() == text
    assert vocab[2] is None  # <|im_end|>: special
    table = TokenTable(vocab, tokenizer.eos_token_ids)
    grammar = json_schema_grammar(PERSON)
    cache = MaskCache(table)
    for prefix in [b"", b'{"name":"B', b'{"name":"Bo","tags":[', b'{"name":"Bo\xc3', b'{"name":"Bo","age":1']:
        state = grammar.automaton.feed(grammar.automaton.start(), prefix)
        mask = cache.mask(grammar, state)
        expected = {i for i, data in enumerate(vocab) if data and i not in table.eos_ids
                    and grammar.automaton.feed(state, data)}
        assert {i for i, bit in enumerate(mask) if bit and i not in table.eos_ids} == expected, prefix
    guide = Guide(json_object_grammar(), MaskCache(table))
    for token_id in tokenizer.encode('{"a": "é", "b": [1, 2]}'):
        assert guide.allowed()[token_id] and guide.advance(token_id)
    assert guide.done


def test_sampler_masks_constrain_greedy_and_sampled_rows_and_leave_others_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, 16)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    allowed = [bytearray(16), bytearray(16), None]
    allowed[0][5] = allowed[1][3] = allowed[1][9] = 1
    sampler = Sampler()
    for _ in range(20):
        out = sampler(logits, params, allowed=allowed).tolist()
        assert out[0] == 5 and out[1] in (3, 9) and out[2] == int(logits[2].argmax())
    greedy = [params[0], params[2]]
    assert torch.equal(sampler(logits[::2], greedy), sampler(logits[::2], greedy, allowed=[None, None]))
    with pytest.raises(ValueError):
        sampler(logits, params, allowed=[bytearray(8), None, None])


def test_guided_choice_options_are_exact_text():
    grammar = choice_grammar(["yes", "no"])
    assert grammar.matches("yes") and not grammar.matches('"yes"')
    with pytest.raises(SchemaError):
        choice_grammar(["", "x"])
    assert choice_grammar(["yes", "no"]) is grammar  # compiled once: its memo and masks carry over
