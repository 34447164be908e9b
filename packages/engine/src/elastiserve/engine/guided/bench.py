"""``python -m elastiserve.engine.guided.bench [MODEL [walk]]``: mask times in the main automaton states on a model's
vocabulary (SmolLM2 by default): the numbers quoted in ``masks``' docstring. ``... MODEL walk``: regex states by the
trie walk instead of the vectorised DFA run (the numbers before it)."""

from __future__ import annotations

import sys
import time

from elastiserve.engine.guided.grammar import json_object_grammar, json_schema_grammar, regex_grammar
from elastiserve.engine.guided.masks import Guide, MaskCache, TokenTable
from elastiserve.engine.guided.vocab import vocabulary_bytes

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "code": {"type": "string", "maxLength": 12}},
          "required": ["name", "age"]}
PATTERN = {"type": "object", "properties": {"id": {"type": "string", "pattern": "[0-9]"}}, "required": ["id"]}
STATES = [  # (label, grammar, text fed before the mask)
    ("json_object, after '{'", json_object_grammar, '{'),
    ("json_object, after ':' (any value)", json_object_grammar, '{"a":'),
    ("json_object, inside a free string", json_object_grammar, '{"a":"x'),
    ("schema, inside a declared key", lambda: json_schema_grammar(SCHEMA), '{"na'),
    ("schema, inside an integer", lambda: json_schema_grammar(SCHEMA), '{"name":"x","age":1'),
    ("schema, inside a maxLength 12 string", lambda: json_schema_grammar(SCHEMA), '{"name":"x","age":1,"code":"ab'),
    ("regex \\d{3}-\\d{4}, at the start", lambda: regex_grammar(r"\d{3}-\d{4}"), ""),
    ("regex [a-z]+@[a-z]+\\.com, after 'ab'", lambda: regex_grammar(r"[a-z]+@[a-z]+\.com"), "ab"),
    ("regex (yes|no), at the start", lambda: regex_grammar("(yes|no)"), ""),
    ("regex .*, at the start", lambda: regex_grammar(".*"), ""),
    ("regex .*, after 'x'", lambda: regex_grammar(".*"), "x"),
    ("schema, inside a pattern string, not yet found", lambda: json_schema_grammar(PATTERN), '{"id":"a'),
    ("schema, inside a pattern string, found", lambda: json_schema_grammar(PATTERN), '{"id":"a1'),
    ("regex [a-z]+@[a-z]+\\.com, after 'ab@c'", lambda: regex_grammar(r"[a-z]+@[a-z]+\.com"), "ab@c"),
    ("regex [^\\n]*é[^\\n]{3}, after 'x'", lambda: regex_grammar(r"[^\n]*é[^\n]{3}"), "x"),
    ("regex [a-z ]{1,64}\\. (a state per count), after 'a'", lambda: regex_grammar(r"[a-z ]{1,64}\."), "a"),
    ("regex .* mid-character (no fast path), after 0xC3", lambda: regex_grammar(".*"), b"\xc3"),
]


def main(model: str = "smollm2", mode: str = "vectorised") -> None:
    """``mode`` "walk": regex states by the trie walk alone (the reference), for the before/after numbers."""
    vectorised = mode != "walk"
    from elastiserve.engine.loader import resolve_model_dir
    from elastiserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_dir(model))
    start = time.perf_counter()
    table = TokenTable(vocabulary_bytes(tokenizer, tokenizer.vocab_size), tokenizer.eos_token_ids)
    print(f"table: {table.size} tokens in {time.perf_counter() - start:.3f} s")
    for label, make, prefix in STATES:
        grammar = make()
        guide = Guide(grammar, MaskCache(table))
        guide.state = grammar.automaton.feed(guide.state, prefix if isinstance(prefix, bytes) else prefix.encode())
        times = []
        for _ in range(5):  # a fresh cache each time: the miss's cost (the transition memo stays warm after one)
            guide.cache = MaskCache(table, vectorised=vectorised)
            start = time.perf_counter()
            mask = guide.allowed()
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(1000):
            guide.allowed()
        hit = (time.perf_counter() - start) / 1000
        print(f"{label}: first miss {times[0] * 1e3:.2f} ms, warm miss {min(times[1:]) * 1e3:.2f} ms, "
              f"hit {hit * 1e6:.2f} us, {sum(mask)} tokens allowed")
    guide = Guide(json_object_grammar(), MaskCache(table))
    ids = tokenizer.encode('{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"]}')
    start = time.perf_counter()
    for token_id in ids:
        guide.advance(token_id)
    print(f"advance: {(time.perf_counter() - start) / len(ids) * 1e6:.1f} us a token over {len(ids)} tokens "
          f"(cold memo), accepted {guide.done}")
    sample_cost(table.size, guide.allowed())


def sample_cost(vocab: int, mask: bytearray, rows: int = 4) -> None:
    """The sampler's side: masking ``rows`` rows of CPU logits (the device copy aside)."""
    import torch

    from elastiserve.engine.sampler import apply_allowed

    logits = torch.randn(rows, vocab)
    apply_allowed(logits, [mask] * rows)
    start = time.perf_counter()
    for _ in range(100):
        apply_allowed(logits, [mask] * rows)
    print(f"sampler mask: {(time.perf_counter() - start) / 100 * 1e3:.2f} ms for {rows} rows")


if __name__ == "__main__":
    main(*sys.argv[1:])
