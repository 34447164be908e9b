"""Structured-output and tool fields of a request, parsed into a `Grammar` (what the output must match) and a
`ToolSpec` (which tools are offered and how the answer is read), with no I/O.

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (one JSON object),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (JSON valid under the schema).
- vLLM's ``guided_json`` (a schema or its JSON text), ``guided_choice`` (the output is exactly one of the
  strings) and ``guided_regex`` (the whole output matches the regex; the subset ``guided.regex_syntax`` lists, any
  other construct a 400 naming it). ``guided_grammar`` is refused with a 400 rather than ignored.
- chat's ``tools`` and ``tool_choice``: ``"none"`` (tools not offered), ``"auto"`` (offered; ``<tool_call>`` blocks in
  the output become ``tool_calls``), ``"required"`` (the output is forced, by a grammar, to a JSON array of one or
  more calls ``{"name": ..., "arguments": ...}`` of the tools, as vLLM reads it; only one with
  ``parallel_tool_calls`` false, which also keeps only the first call of "auto") or a named function (forced to one
  such call of that tool, an object); arguments are valid under the tool's ``parameters``.

Every mistake is a ``BadRequest`` whose ``param`` names the field; a schema keyword the automaton does not support
is named in the message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from elastiserve.engine import protocol
from elastiserve.engine.guided.grammar import (
    Grammar,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    regex_grammar,
)
from elastiserve.engine.guided.schema import SchemaError
from elastiserve.engine.protocol import ParsedRequest
from elastiserve.engine.request_fields import BadRequest

UNSUPPORTED_GUIDES = ("guided_grammar",)
GUIDES = ("response_format", "guided_json", "guided_choice", "guided_regex")
MAX_TOOLS = 128


def _compile(param: str, make: Any, value: Any) -> Grammar:
    try:
        return make(value)
    except SchemaError as exc:
        raise BadRequest(f"'{param}': {exc}", param=param, code="invalid_schema") from exc
    except RecursionError as exc:  # the compiler recurses once a nesting level
        raise BadRequest(f"'{param}': the schema is nested too deeply", param=param, code="invalid_schema") from exc


def _schema_value(value: Any, param: str) -> Any:
    if isinstance(value, str):  # guided_json may be the schema's JSON text
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:  # ValueError: also an integer past the digit limit
            raise BadRequest(f"'{param}' is not valid JSON: {exc}", param=param, code="invalid_type") from exc
    if not isinstance(value, dict):
        raise BadRequest(f"'{param}' must be a JSON schema object", param=param, code="invalid_type")
    return value


def _response_format(value: Any) -> Grammar | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise BadRequest("'response_format' must be an object with a string 'type'", param=param,
                         code="invalid_type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadRequest("'response_format' of type json_schema needs 'json_schema': {\"name\": ..., \"schema\": "
                             "{...}}", param=param)
        return _compile(param, json_schema_grammar, _schema_value(spec["schema"], param))
    raise BadRequest(f"'response_format' type {kind!r} is not one of text, json_object, json_schema", param=param)


def parse_guide(body: dict) -> Grammar | None:
    """The grammar the request's output must match, from whichever one of the guide fields it sets."""
    for name in UNSUPPORTED_GUIDES:
        if body.get(name) is not None:
            raise BadRequest(f"'{name}' is not supported; use guided_json, guided_choice, guided_regex or "
                             "response_format",
                             param=name)
    given = [name for name in GUIDES if body.get(name) is not None]
    if len(given) > 1:
        raise BadRequest(f"set only one of {', '.join(given)}", param=given[1])
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        return _response_format(body[name])
    if name == "guided_json":
        return _compile(name, json_schema_grammar, _schema_value(body[name], name))
    if name == "guided_regex":
        return _compile(name, regex_grammar, body[name])
    return _compile(name, choice_grammar, body[name])


@dataclass(frozen=True)
class ToolSpec:
    """The tools offered to the model and how its answer is read. ``choice``: "auto", "required" or "named" (then
    ``name`` is the function); ``parallel``: the request's ``parallel_tool_calls`` (False: "required" makes one call).
    """

    tools: tuple[dict[str, Any], ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.choice not in ("auto", "required", "named"):
            raise ValueError(f"tool choice {self.choice!r} is not auto, required or named")
        if (self.choice == "named") != (self.name is not None):
            raise ValueError("a named tool choice needs exactly the name")

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def call_schema(self) -> dict[str, Any]:
        """The schema of the forced output: one call of the named tool, or an array of calls of any of them (at
        least one; exactly one when calls may not run in parallel)."""
        options = [_call_schema(t["function"]) for t in self.tools
                   if self.name is None or t["function"]["name"] == self.name]
        call = options[0] if len(options) == 1 else {"anyOf": options}
        if self.choice == "named":
            return call
        return {"type": "array", "items": call, "minItems": 1} | ({} if self.parallel else {"maxItems": 1})


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(tools, list) or not tools:
        raise BadRequest("'tools' must be a non-empty list", param="tools", code="invalid_type")
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' takes at most {MAX_TOOLS} functions", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools",
                             code="invalid_type")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tools[{i}].function.name must be a non-empty string", param="tools")
        if name in names:
            raise BadRequest(f"tools[{i}]: the function name {name!r} is used twice", param="tools")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    return tuple({"type": "function", "function": t["function"]} for t in tools)


def parse_tools(body: dict, parallel: bool = True) -> ToolSpec | None:
    """The tools offered (None: none, or ``tool_choice`` "none"); ``parallel`` is ``parallel_tool_calls``."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise BadRequest("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    checked = _check_tools(tools)
    if choice in (None, "auto"):
        return ToolSpec(checked, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolSpec(checked, "required", parallel=parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or choice.get("type", "function") != "function":
        raise BadRequest("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}", param="tool_choice", code="invalid_type")
    name = function.get("name")
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in checked}:
        raise BadRequest(f"'tool_choice' names the function {name!r}, which is not in 'tools'", param="tool_choice")
    return ToolSpec(checked, "named", name, parallel)


def tool_grammar(spec: ToolSpec) -> Grammar:
    """The forced call's grammar; a tool whose parameters cannot be compiled is a 400 on ``tools``."""
    return _compile("tools", json_schema_grammar, spec.call_schema())


def with_structure(req: ParsedRequest, body: dict) -> ParsedRequest:
    """``req`` (parsed by ``protocol``) with its grammar in ``sampling["guide"]`` and, for chat, its tools."""
    guide = parse_guide(body)
    tools = parse_tools(body, req.parallel_tool_calls) if req.kind == "chat" else None
    if req.kind != "chat" and body.get("tools") is not None:
        raise BadRequest("'tools' are a chat completions field", param="tools")
    if tools is not None and tools.forced:
        if guide is not None:
            raise BadRequest("a required or named 'tool_choice' already fixes the output: drop response_format / "
                             "guided_*", param="tool_choice")
        guide = tool_grammar(tools)
    if guide is not None:
        req.sampling["guide"] = guide
    req.tools = tools
    return req


def parse_completion(body: Any) -> ParsedRequest:
    return with_structure(protocol.parse_completion(body), body)


def parse_chat(body: Any) -> ParsedRequest:
    return with_structure(protocol.parse_chat(body), body)
