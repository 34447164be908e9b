"""JSON Schema (a practical subset) compiled into the automaton's nodes.

A node is one of six shapes, kept in a list and referred to by index, so that automaton states stay small hashable
tuples and ``$ref`` cycles need no special case (a reference gets its index before its target is compiled):

- ``ObjectNode``: declared properties in declared order (each optional one may be left out, a required one may not),
  then, with ``additionalProperties`` true or a schema, further keys of any name. ``additionalProperties`` left out
  counts as false, as OpenAI's strict mode and xgrammar's default have it: the output still conforms.
- ``ArrayNode``: ``items`` (one schema), ``minItems`` / ``maxItems``.
- ``StringNode``: any string, ``minLength`` / ``maxLength`` in characters.
- ``PatternNode``: a string whose characters match ``pattern`` (``regex``'s automaton over the raw bytes between the
  quotes). ECMA's ``pattern`` is a search: an unanchored pattern may match anywhere, so a branch not starting with
  ``^`` gets any text before it and one not ending with ``$`` any text after it (``"^[a-z]+$"`` is a whole match,
  ``"[0-9]"`` means "contains a digit"). Such a string is written without escapes: the regex reads the raw bytes,
  from which the quote, the backslash and control characters are left out (a pattern that needs one of them to
  match anything is refused), and ``pattern`` together with ``minLength`` / ``maxLength`` is refused (the two could
  leave a live prefix with no valid end).
- ``NumberNode``: an integer or any JSON number.
- ``LiteralNode``: a set of exact byte strings: ``enum`` / ``const`` values written as compact JSON, booleans,
  null, and ``guided_choice``'s raw texts.
- ``UnionNode``: ``anyOf`` / ``oneOf`` (both read as anyOf: the automaton follows every branch at once, so
  overlapping branches are allowed, not excluded) and ``type`` lists.

Keywords that change which documents are valid but are not supported (``format``, ``minimum``, ...)
raise ``UnsupportedSchema`` naming the keyword; descriptive ones (``title``, ``description``, ``examples``, ...)
are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from elastiserve.engine.errors import InvalidRequest


class SchemaError(InvalidRequest):
    """A schema (or choice list) that cannot be compiled: malformed, or using a keyword that is not supported."""

    def __init__(self, message: str, keyword: str | None = None) -> None:
        super().__init__(message)
        self.keyword = keyword


class UnsupportedSchema(SchemaError):
    """A well-formed schema keyword that changes validity but that the automaton does not enforce."""


@dataclass(frozen=True, slots=True)
class ObjectNode:
    properties: tuple[tuple[bytes, int], ...]  # (the key's JSON text after its opening quote, value node)
    required: frozenset[int]  # indices into properties
    extra: int | None  # node of additional properties' values; None: no other keys

    def candidates(self, index: int) -> list[int]:
        """The declared properties that may come next when ``index`` is the first one not yet passed: each up to
        and including the first required one (a required property cannot be skipped)."""
        out = []
        for j in range(index, len(self.properties)):
            out.append(j)
            if j in self.required:
                break
        return out

    def may_close(self, index: int) -> bool:
        return not any(j >= index for j in self.required)


@dataclass(frozen=True, slots=True)
class ArrayNode:
    items: int
    min_items: int = 0
    max_items: int | None = None


@dataclass(frozen=True, slots=True)
class StringNode:
    min_length: int = 0
    max_length: int | None = None


@dataclass(frozen=True, slots=True)
class PatternNode:
    regex: Any = field(compare=False)  # a regex.RegexAutomaton over the string's raw bytes
    pattern: str = ""


@dataclass(frozen=True, slots=True)
class NumberNode:
    integer: bool


@dataclass(frozen=True, slots=True)
class LiteralNode:
    options: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class UnionNode:
    options: tuple[int, ...]


Node = ObjectNode | ArrayNode | StringNode | PatternNode | NumberNode | LiteralNode | UnionNode

DESCRIPTIVE = frozenset({"title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions"})
SUPPORTED = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                       "enum", "const", "anyOf", "oneOf", "$ref", "minLength", "maxLength", "pattern"})
# Bytes a pattern-constrained string never contains raw: the quote ends it, the backslash starts an escape, and
# control characters must be escaped in JSON.
NOT_IN_PATTERN_STRINGS = frozenset({*range(0x20), 0x22, 0x5C})
JSON_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


def compact_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


class SchemaCompiler:
    """Compiles one schema (with its ``$defs`` / ``definitions``) into ``nodes``; ``root`` is the document's node."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self._refs: dict[str, int] = {}
        self._document: dict = {}
        self._any: int | None = None

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def compile_document(self, schema: Any) -> int:
        self._document = schema if isinstance(schema, dict) else {}
        return self.compile(schema, "schema")

    def any_value(self) -> int:
        """Any JSON value (the schema ``{}`` or ``true``; ``json_object``'s values)."""
        if self._any is None:
            self._any = self.add(UnionNode(()))  # filled in below: its options refer back to it
            obj = self.add(ObjectNode((), frozenset(), self._any))
            arr = self.add(ArrayNode(self._any))
            scalars = [self.add(StringNode()), self.add(NumberNode(False)),
                       self.add(LiteralNode((b"true", b"false", b"null")))]
            self.nodes[self._any] = UnionNode((obj, arr, *scalars))
        return self._any

    def any_object(self) -> int:
        return self.add(ObjectNode((), frozenset(), self.any_value()))

    def compile(self, schema: Any, where: str) -> int:
        if schema is True or schema == {}:
            return self.any_value()
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object or true, got {json.dumps(schema)[:60]}")
        for keyword in schema:
            if keyword not in SUPPORTED and keyword not in DESCRIPTIVE:
                raise UnsupportedSchema(f"{where}: the schema keyword {keyword!r} is not supported", keyword)
        if "$ref" in schema:
            return self._ref(schema["$ref"], where)
        if "const" in schema:
            return self.add(LiteralNode((compact_json(schema["const"]),)))
        if "enum" in schema:
            return self._enum(schema, where)
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                options = schema[keyword]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"{where}.{keyword} must be a non-empty list", keyword)
                return self._union([self.compile(o, f"{where}.{keyword}[{i}]") for i, o in enumerate(options)])
        types = schema.get("type")
        if types is None:
            types = self._implied_type(schema)
            if types is None:
                return self.any_value()
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types or any(t not in JSON_TYPES for t in types):
            raise SchemaError(f"{where}.type must be one of {', '.join(JSON_TYPES)} (or a list of them)", "type")
        return self._union([self._typed(t, schema, where) for t in dict.fromkeys(types)])

    @staticmethod
    def _implied_type(schema: dict) -> str | None:
        if "properties" in schema or "required" in schema or "additionalProperties" in schema:
            return "object"
        if "items" in schema or "minItems" in schema or "maxItems" in schema:
            return "array"
        if "minLength" in schema or "maxLength" in schema or "pattern" in schema:
            return "string"
        return None

    def _union(self, options: list[int]) -> int:
        flat: list[int] = []
        for option in options:  # nested unions flatten, so expanding a union never recurses into another
            node = self.nodes[option]
            flat += node.options if isinstance(node, UnionNode) and node.options else [option]
        return flat[0] if len(flat) == 1 else self.add(UnionNode(tuple(dict.fromkeys(flat))))

    def _enum(self, schema: dict, where: str) -> int:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"{where}.enum must be a non-empty list", "enum")
        types = schema.get("type")
        if types is not None:
            if not isinstance(types, (str, list)) or not all(isinstance(t, str) for t in types):
                raise SchemaError(f"{where}.type must be one of {', '.join(JSON_TYPES)} (or a list of them)", "type")
            allowed = {types} if isinstance(types, str) else set(types)
            if "number" in allowed:
                allowed.add("integer")
            values = [v for v in values if _json_type(v) in allowed]
            if not values:
                raise SchemaError(f"{where}: no enum value has the type {types}", "enum")
        if "pattern" in schema:  # the pattern applies to string values only
            regex = _compile_pattern(schema["pattern"], where, frozenset())
            values = [v for v in values if not isinstance(v, str) or regex.matches(v)]
            if not values:
                raise SchemaError(f"{where}: no enum value matches the pattern", "pattern")
        return self.add(LiteralNode(tuple(dict.fromkeys(compact_json(v) for v in values))))

    def _ref(self, ref: Any, where: str) -> int:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise UnsupportedSchema(f"{where}.$ref: only local references (#/$defs/...) are supported", "$ref")
        if ref in self._refs:
            return self._refs[ref]
        target: Any = self._document
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"{where}.$ref {ref!r} points at nothing", "$ref")
            target = target[part]
        placeholder = self._refs[ref] = self.add(UnionNode(()))
        compiled = self.compile(target, ref)
        if compiled == placeholder:
            raise SchemaError(f"{where}.$ref {ref!r} refers to itself", "$ref")
        # The placeholder becomes a one-option union (expanding it costs one step): earlier references keep it.
        self.nodes[placeholder] = UnionNode((compiled,))
        return placeholder

    def _typed(self, kind: str, schema: dict, where: str) -> int:
        if kind == "object":
            return self._object(schema, where)
        if kind == "array":
            items = schema.get("items", True)
            low, high = _bounds(schema, "minItems", "maxItems", where)
            return self.add(ArrayNode(self.compile(items, f"{where}.items"), low, high))
        if kind == "string":
            if "pattern" in schema:
                return self._pattern(schema, where)
            low, high = _bounds(schema, "minLength", "maxLength", where)
            return self.add(StringNode(low, high))
        if kind in ("integer", "number"):
            return self.add(NumberNode(kind == "integer"))
        return self.add(LiteralNode((b"true", b"false") if kind == "boolean" else (b"null",)))

    def _pattern(self, schema: dict, where: str) -> int:
        for name in ("minLength", "maxLength"):
            if name in schema:
                raise UnsupportedSchema(f"{where}: 'pattern' together with {name!r} is not supported", "pattern")
        regex = _compile_pattern(schema["pattern"], where, NOT_IN_PATTERN_STRINGS)
        if not regex.can_match:
            raise UnsupportedSchema(f"{where}.pattern matches only strings that need JSON escapes (a quote, a "
                                    "backslash or a control character), which pattern strings leave out", "pattern")
        return self.add(PatternNode(regex, schema["pattern"]))

    def _object(self, schema: dict, where: str) -> int:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict):
            raise SchemaError(f"{where}.properties must be an object", "properties")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{where}.required must be a list of strings", "required")
        missing = [r for r in required if r not in properties]
        if missing:
            raise UnsupportedSchema(f"{where}.required names {missing[0]!r}, which is not in properties", "required")
        compiled = tuple((compact_json(name)[1:], self.compile(sub, f"{where}.properties.{name}"))
                         for name, sub in properties.items())
        required_index = frozenset(i for i, name in enumerate(properties) if name in set(required))
        additional = schema.get("additionalProperties", False)
        if additional is False:
            extra = None
        elif additional is True or isinstance(additional, dict):
            extra = self.compile(additional, f"{where}.additionalProperties")
        else:
            raise SchemaError(f"{where}.additionalProperties must be a boolean or a schema", "additionalProperties")
        if not properties and extra is None and "additionalProperties" not in schema:
            extra = self.any_value()  # {"type": "object"} alone: any object
        return self.add(ObjectNode(compiled, required_index, extra))


def _compile_pattern(pattern: Any, where: str, excluded: frozenset[int]) -> Any:
    from elastiserve.engine.guided import regex  # regex's errors subclass SchemaError: imported here, not above

    if not isinstance(pattern, str):
        raise SchemaError(f"{where}.pattern must be a string", "pattern")
    try:
        return regex.compile_regex(pattern, search=True, excluded=excluded)
    except regex.RegexError as exc:
        raise type(exc)(f"{where}.pattern {pattern!r}: {exc}") from exc


def _bounds(schema: dict, low_name: str, high_name: str, where: str) -> tuple[int, int | None]:
    low, high = schema.get(low_name, 0), schema.get(high_name)
    for name, value in ((low_name, low), (high_name, high)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise SchemaError(f"{where}.{name} must be a non-negative integer", name)
    if high is not None and high < low:
        raise SchemaError(f"{where}: {high_name} {high} is below {low_name} {low}", high_name)
    return low, high
