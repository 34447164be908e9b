"""Grammars: a compiled automaton with a key that names what it accepts.

The same request shape (one schema, one choice list, one regex) compiles to the same ``Grammar`` object (an LRU
keyed by the canonical JSON of the spec, or the regex's text), so its transition memo and the engine's mask cache
carry over from request to request.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from elastiserve.engine.guided.automaton import JsonAutomaton
from elastiserve.engine.guided.regex import RegexAutomaton, RegexError
from elastiserve.engine.guided.schema import LiteralNode, SchemaCompiler, SchemaError, UnionNode

MAX_CHOICES = 256
MAX_SCHEMA_BYTES = 64 * 1024


@dataclass(eq=False)
class Grammar:
    """What a guided request's output must be; ``key`` is readable and unique per distinct spec."""

    key: str
    automaton: JsonAutomaton | RegexAutomaton = field(repr=False)

    def matches(self, text: str) -> bool:
        return self.automaton.matches(text)


def _check_union_cycles(nodes: list) -> None:
    """A union that reaches itself through unions alone would expand forever without reading a byte."""
    def visit(index: int, path: frozenset[int]) -> None:
        node = nodes[index]
        if not isinstance(node, UnionNode):
            return
        if index in path:
            raise SchemaError("the schema refers to itself without an object or array in between", "$ref")
        for option in node.options:
            visit(option, path | {index})

    for i in range(len(nodes)):
        visit(i, frozenset())


def _canonical(value: Any) -> str:
    # Key order is kept: properties are emitted in declared order, so it is part of what the grammar means.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@functools.lru_cache(maxsize=64)
def _schema_grammar(text: str) -> Grammar:
    schema = json.loads(text)
    compiler = SchemaCompiler()
    root = compiler.compile_document(schema)
    _check_union_cycles(compiler.nodes)
    return Grammar(f"json_schema:{text}", JsonAutomaton(compiler.nodes, root))


def json_schema_grammar(schema: Any) -> Grammar:
    """Documents valid under ``schema`` (a dict, or ``true``); raises ``SchemaError``."""
    if not isinstance(schema, (dict, bool)) or schema is False:
        raise SchemaError("a JSON schema must be an object")
    text = _canonical(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise SchemaError(f"the schema is over {MAX_SCHEMA_BYTES} bytes")
    return _schema_grammar(text)


@functools.lru_cache(maxsize=1)
def json_object_grammar() -> Grammar:
    """Any one JSON object (``response_format`` ``json_object``)."""
    compiler = SchemaCompiler()
    root = compiler.any_object()
    return Grammar("json_object", JsonAutomaton(compiler.nodes, root))


@functools.lru_cache(maxsize=64)
def _choice_grammar(choices: tuple[str, ...]) -> Grammar:
    options = tuple(dict.fromkeys(c.encode() for c in choices))
    return Grammar(f"choice:{_canonical(list(choices))}", JsonAutomaton([LiteralNode(options)], 0))


def choice_grammar(choices: Any) -> Grammar:
    """Exactly one of ``choices`` (non-empty strings), as raw text (vLLM's ``guided_choice``)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise SchemaError("guided_choice must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise SchemaError(f"guided_choice takes at most {MAX_CHOICES} choices")
    return _choice_grammar(tuple(choices))


@functools.lru_cache(maxsize=64)
def _regex_grammar(pattern: str) -> Grammar:
    automaton = RegexAutomaton(pattern)
    if not automaton.can_match:
        raise RegexError("the regex matches no string")
    return Grammar(f"regex:{pattern}", automaton)


def regex_grammar(pattern: Any) -> Grammar:
    """Text that matches ``pattern`` as a whole (vLLM's ``guided_regex``); raises ``RegexError``."""
    if not isinstance(pattern, str):
        raise RegexError("guided_regex must be a string")
    return _regex_grammar(pattern)
