"""The input file of ``elastiserve generate``: one JSON object a line, read and checked whole before the model loads,
through the server's own field readers, so that a typo on line 900 costs a second, not a model load. A line gives its
prompt as exactly one of ``prompt`` (text), ``messages`` (a chat, rendered by the model's template) or
``prompt_token_ids``, and any sampling field of a completions request (``logprobs`` is a count, as there; ``n`` and
``best_of`` as there, without streaming); other keys ride along into the output row. What needs the model (the
vocabulary, the context length) the engine checks when the request is added. Plain Python."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastiserve.engine.errors import InvalidRequest
from elastiserve.engine.protocol import parse_choices, parse_messages, parse_sampling, parse_stop, set_logprobs
from elastiserve.engine.request_fields import BadRequest, integer
from elastiserve.engine.sampling import INT64_END, SamplingParams
from elastiserve.platforms.errors import ConfigError

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")


@dataclass(frozen=True, slots=True)
class GenerateLine:
    lineno: int  # in the file, from 1 (blank lines are skipped and counted)
    record: dict[str, Any]  # the line as read, echoed into its output row
    prompt: str | list[int] | list[dict[str, Any]]  # text, token ids, or the chat's messages (``is_chat``)
    is_chat: bool
    params: SamplingParams
    n: int = 1  # completions returned for the line
    best_of: int = 1  # candidates generated, the n best returned (n <= best_of)


def read_generate_input(path: Path, defaults: dict[str, Any]) -> list[GenerateLine]:
    """Every request of ``path``, each line's sampling fields over ``defaults`` (the command's flags); a
    ``ConfigError`` naming the file and line for the first line that cannot be served by any model."""
    try:  # the flags alone first, so a bad --top-k is not blamed on line 1
        SamplingParams(**defaults).validate(vocab_size=INT64_END, max_model_len=INT64_END, prompt_len=1)
    except InvalidRequest as exc:
        raise ConfigError(f"the sampling flags: {exc}") from None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--input {path}: {exc}") from None
    lines = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            lines.append(_read_line(raw, lineno, defaults))
        except (BadRequest, InvalidRequest) as exc:
            raise ConfigError(f"{path} line {lineno}: {exc}") from None
    if not lines:
        raise ConfigError(f"--input {path} holds no request (one JSON object a line)")
    return lines


def _read_line(raw: str, lineno: int, defaults: dict[str, Any]) -> GenerateLine:
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError, as is a digit-limit overflow
        raise BadRequest(f"not JSON: {str(exc)[:120]}") from None
    if not isinstance(record, dict):
        raise BadRequest(f"expected a JSON object, got {type(record).__name__}")
    prompt, is_chat = _prompt(record)
    sampling = parse_sampling(record, ("max_tokens",))
    set_logprobs(sampling, integer(record, "logprobs"), "logprobs")
    params = SamplingParams(**{**defaults, **sampling}, stop=parse_stop(record))
    n, best_of = parse_choices(record, False, {"temperature": params.temperature})
    # The model-free half of the engine's check: no vocabulary or context bound yet, one prompt token.
    params.validate(vocab_size=INT64_END, max_model_len=INT64_END, prompt_len=1)
    return GenerateLine(lineno, record, prompt, is_chat, params, n, best_of)


def _prompt(record: dict[str, Any]) -> tuple[str | list[int] | list[dict[str, Any]], bool]:
    given = [key for key in PROMPT_KEYS if key in record]
    if len(given) != 1:
        found = f" (it has {', '.join(given)})" if given else ""
        raise BadRequest(f"expected exactly one of 'prompt', 'messages' or 'prompt_token_ids'{found}")
    if given[0] == "messages":
        return parse_messages(record), True
    value = record[given[0]]
    if given[0] == "prompt":
        if not isinstance(value, str):
            raise BadRequest(f"'prompt' must be a string, got {type(value).__name__} (token ids: 'prompt_token_ids')")
        return value, False
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest("'prompt_token_ids' must be a list of integers")
    return value, False
