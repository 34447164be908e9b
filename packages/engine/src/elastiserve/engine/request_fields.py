"""The OpenAI error every user mistake raises (``BadRequest``: HTTP 400 with the error body's message, param and
code) and the typed readers of a request body's fields that raise it; plain Python, no I/O."""

from __future__ import annotations

import math
from typing import Any

from elastiserve.engine.sampling import INT64_END
from elastiserve.platforms.errors import ElastiserveError


class BadRequest(ElastiserveError, ValueError):
    """A request the server refuses with HTTP 400 and an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def check_type(body: dict, name: str, types: tuple[type, ...], type_name: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int subclass: JSON true is never a number here.
    if isinstance(value, bool) and bool not in types:
        raise BadRequest(f"'{name}' must be {type_name}, got a boolean", param=name, code="invalid_type")
    if not isinstance(value, types):
        raise BadRequest(f"'{name}' must be {type_name}, got {type(value).__name__}", param=name, code="invalid_type")
    return value


def finite(value: int | float, param: str, what: str | None = None) -> float:
    """``value`` as a float; NaN, Infinity (Python's json reads them) and integers past a float's range are 400s."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise BadRequest(f"{what or repr(param)} must be a finite number, got {str(value)[:40]}", param=param)
    return number


def number(body: dict, name: str) -> float | None:
    value = check_type(body, name, (int, float), "a number")
    return None if value is None else finite(value, name)


def integer(body: dict, name: str) -> int | None:
    value = check_type(body, name, (int,), "an integer")
    if value is not None and not -INT64_END <= value < INT64_END:  # as vLLM; a seed or top_k past it fails a step
        raise BadRequest(f"'{name}' must be a 64-bit integer, got {str(value)[:40]}", param=name)
    return value
