"""OpenAI response bodies, with no I/O: whole responses, streamed chunks, logprobs objects and the model list, for a
``protocol.ParsedRequest``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from elastiserve.engine.protocol import ParsedRequest


def new_id(kind: str) -> str:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk_body(req: ParsedRequest, request_id: str, created: int, text: str | None, finish_reason: str | None,
               first: bool = False, logprobs: dict | None = None, index: int = 0) -> dict[str, Any]:
    """One streamed chunk of choice ``index``; ``text`` None with a finish reason closes the choice."""
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": request_id, "object": obj, "created": created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        body["usage"] = None  # OpenAI sends null usage on every chunk but the last one
    return body


def usage_chunk(req: ParsedRequest, request_id: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def full_body(req: ParsedRequest, request_id: str, choices: list[tuple[str, str | None, dict | None]],
              prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The whole response; ``choices``: (text, finish reason, logprobs object) per choice, in index order."""
    if req.kind == "chat":
        bodies = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                   "finish_reason": finish_reason} for i, (text, finish_reason, logprobs) in enumerate(choices)]
        obj = "chat.completion"
    else:
        bodies = [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
                  for i, (text, finish_reason, logprobs) in enumerate(choices)]
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": req.model, "choices": bodies,
            "usage": usage(prompt_tokens, completion_tokens)}


def logprobs_body(req: ParsedRequest, entries: list[Any], token_text: Any, text_offset: int = 0) -> dict | None:
    """OpenAI's logprobs object for ``entries`` (``TokenLogprob``s; ``token_text(id)`` is a token's text): chat's
    ``content`` list, or the completions arrays with character offsets from ``text_offset``. None when the request
    did not ask for logprobs."""
    if req.sampling.get("logprobs") is None:
        return None
    if req.kind == "chat":
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}
    tokens = [token_text(e.token_id) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    # A prompt's first token has no logprob: OpenAI writes null for it and for its alternatives.
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else {token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def models_body(model_names: list[str]) -> dict[str, Any]:
    created = int(time.time())
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "elastiserve"}
                                       for name in model_names]}
