"""OpenAI request parsing, with no I/O: the server turns JSON into a `ParsedRequest` here (the response bodies are
built in ``responses.py``).

Every user mistake raises `BadRequest` carrying the OpenAI error fields (message, param, code); the server answers it
with HTTP 400. A completions ``prompt`` may be a batch (up to ``MAX_PROMPTS``): prompt ``p``'s choices have indices
``p * n`` to ``p * n + n - 1``, as in vLLM. ``n`` choices are served (up to ``MAX_N``); ``best_of`` candidates
(n <= best_of <= MAX_N) are generated and the ``n`` with the highest log-probability per token returned, as OpenAI
defines it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastiserve.engine.request_fields import BadRequest, check_type, finite, integer, number


@dataclass(frozen=True)
class TemplateOptions:
    """vLLM's chat-template request options: extra template variables (``chat_template_kwargs``, such as Qwen3's
    ``enable_thinking``), whether the assistant's turn is opened (``add_generation_prompt``), or instead the final
    message left open for the model to continue (``continue_final_message``)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# Template variables the server sets itself; a request's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


def _parse_template_options(body: dict, messages: list[dict[str, Any]]) -> TemplateOptions:
    kwargs = check_type(body, "chat_template_kwargs", (dict,), "an object") or {}
    taken = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if taken:
        raise BadRequest(f"'chat_template_kwargs' may not set {taken}: the server sets them (use the request's own "
                         "fields)", param="chat_template_kwargs")
    generation = check_type(body, "add_generation_prompt", (bool,), "a boolean")
    continues = bool(check_type(body, "continue_final_message", (bool,), "a boolean"))
    if continues and generation:
        raise BadRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true: the model either "
                         "continues the final message or starts a new one", param="continue_final_message")
    if continues and not messages[-1]["content"].strip():
        raise BadRequest("'continue_final_message' needs a final message with text to continue",
                         param="continue_final_message")
    return TemplateOptions(dict(kwargs), add_generation_prompt=not continues and generation is not False,
                           continue_final_message=continues)


@dataclass
class ParsedRequest:
    """One completion or chat request reduced to what the engine and the response writer need."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: text or token ids, one or a batch
    messages: list[dict[str, Any]] | None = None  # chat
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk
    echo: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # keyword arguments for SamplingParams
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: the stop string that ended it is kept
    skip_special_tokens: bool = True  # vLLM's: special tokens' text is left out of the output
    n: int = 1  # choices returned
    best_of: int = 1  # candidates generated, each its own engine request; the n best are returned
    tools: Any = None  # chat: a structured.ToolSpec when tools are offered
    parallel_tool_calls: bool = True  # chat: False lets a "required" tool_choice make one call only
    template: TemplateOptions = field(default_factory=TemplateOptions)  # chat: how the template renders
    priority: int = 0  # vLLM's: lower is served first, where the engine schedules by priority
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: the context's length)

    @property
    def max_tokens(self) -> int:
        return int(self.sampling.get("max_tokens", 16))


def parse_stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of non-empty strings", param="stop",
                         code="invalid_type")
    if len(stop) > 16:
        raise BadRequest("'stop' takes at most 16 strings", param="stop")
    return tuple(stop)


def parse_sampling(body: dict, max_tokens_names: tuple[str, ...]) -> dict[str, Any]:
    sampling: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = number(body, name)
        if value is not None:
            sampling[name] = value
    for name in ("top_k", "seed", "min_tokens"):
        value = integer(body, name)
        if value is not None:
            sampling[name] = value
    for name in max_tokens_names:
        value = integer(body, name)
        if value is not None:
            if value < 0:
                raise BadRequest(f"'{name}' must be at least 1, got {value}", param=name)
            sampling["max_tokens"] = value
            break
    bias = check_type(body, "logit_bias", (dict,), "an object")
    if bias:
        sampling["logit_bias"] = _parse_logit_bias(bias)
    ignore_eos = check_type(body, "ignore_eos", (bool,), "a boolean")
    if ignore_eos is not None:
        sampling["ignore_eos"] = ignore_eos
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise BadRequest("'stop_token_ids' must be a list of integers", param="stop_token_ids",
                             code="invalid_type")
        sampling["stop_token_ids"] = tuple(stop_ids)
    return sampling


def _parse_logit_bias(bias: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys, so strings) to numbers; the range checks against the
    vocabulary are ``SamplingParams.validate``'s."""
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias",
                             code="invalid_type") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"'logit_bias' values must be numbers, got {value!r}", param="logit_bias",
                             code="invalid_type")
        pairs.append((token, finite(value, "logit_bias", "'logit_bias' values")))
    return tuple(pairs)


MAX_N = 64  # choices per request


def parse_choices(body: dict, stream: bool, sampling: dict[str, Any]) -> tuple[int, int]:
    """``n`` and ``best_of`` (default ``n``). Candidates beyond ``n`` are ranked once all have finished, so they
    cannot stream (OpenAI refuses the same), and greedy candidates are all the same text, so there is nothing to
    rank (vLLM refused greedy best_of too)."""
    n = integer(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"'n' must be between 1 and {MAX_N}, got {n}", param="n")
    best_of = integer(body, "best_of")
    best_of = n if best_of is None else best_of
    if not n <= best_of <= MAX_N:
        raise BadRequest(f"'best_of' must be between n ({n}) and {MAX_N}, got {best_of}", param="best_of")
    if best_of > n and stream:
        raise BadRequest("'best_of' above 'n' cannot be streamed: the best are known only when all have finished",
                         param="best_of")
    if best_of > n and sampling.get("temperature") == 0.0:
        raise BadRequest("'best_of' above 'n' needs sampling: with temperature 0 every candidate is the same",
                         param="best_of")
    return n, best_of


def _stream_flags(body: dict) -> dict[str, bool]:
    stream = bool(check_type(body, "stream", (bool,), "a boolean"))
    options = check_type(body, "stream_options", (dict,), "an object") or {}
    flags = {"stream": stream}
    for name, field_name in (("include_usage", "include_usage"), ("continuous_usage_stats", "continuous_usage")):
        value = options.get(name, False)
        if not isinstance(value, bool):
            raise BadRequest(f"'stream_options.{name}' must be a boolean", param="stream_options",
                             code="invalid_type")
        flags[field_name] = value
    return flags


def _extras(body: dict) -> dict[str, Any]:
    """vLLM's request extras: the output-text booleans and the scheduling priority, as ParsedRequest fields."""
    include = check_type(body, "include_stop_str_in_output", (bool,), "a boolean")
    skip = check_type(body, "skip_special_tokens", (bool,), "a boolean")
    truncate = integer(body, "truncate_prompt_tokens")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise BadRequest(f"'truncate_prompt_tokens' must be at least 1 (or -1: the context's length), got {truncate}",
                         param="truncate_prompt_tokens")
    return {"include_stop_str": bool(include), "skip_special_tokens": skip is not False,
            "priority": integer(body, "priority") or 0, "truncate_prompt_tokens": truncate}


def _require_model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model", code="invalid_type")
    return model


def parse_completion(body: Any) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = _require_model(body)
    prompts = _parse_prompts(body.get("prompt"))
    flags = _stream_flags(body)
    echo = bool(check_type(body, "echo", (bool,), "a boolean"))
    if check_type(body, "suffix", (str,), "a string"):  # refused, not dropped: the text after it would be wrong
        raise BadRequest("'suffix' (fill-in-the-middle) is not supported", param="suffix", code="unsupported")
    sampling = parse_sampling(body, ("max_tokens",))
    n, best_of = parse_choices(body, flags["stream"], sampling)
    if len(prompts) * best_of > MAX_CANDIDATES:
        raise BadRequest(f"{len(prompts)} prompts x best_of {best_of} is over {MAX_CANDIDATES} sequences a request",
                         param="prompt")
    set_logprobs(sampling, integer(body, "logprobs"), "logprobs")
    if echo and "logprobs" in sampling:  # OpenAI's echo with logprobs scores the prompt too
        sampling["prompt_logprobs"] = sampling["logprobs"]
    if sampling.get("max_tokens") == 0 and "prompt_logprobs" not in sampling:
        raise BadRequest("'max_tokens' 0 only scores the prompt: it needs 'echo' with 'logprobs'", param="max_tokens")
    return ParsedRequest("completion", model, prompts=prompts, echo=echo, sampling=sampling, stop=parse_stop(body),
                         n=n, best_of=best_of, **flags, **_extras(body))


MAX_PROMPTS = 256  # prompts in one completions request (a batch: each its own choices, as vLLM serves them)
MAX_CANDIDATES = 1024  # engine requests one HTTP request may start (prompts x best_of)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _parse_prompts(prompt: Any) -> list[str | list[int]]:
    """A string, a list of token ids, or a batch of either (a list of strings or of token-id lists)."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if prompt is None:
        raise BadRequest("'prompt' is required: a string, a list of token ids, or a list of either",
                         param="prompt", code="invalid_type")
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                 or all(_is_token_ids(p) for p in prompt)):
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} a request",
                             param="prompt")
        return list(prompt)
    raise BadRequest("'prompt' must be a string, a non-empty list of token ids, or a non-empty list of strings or of "
                     "token-id lists", param="prompt", code="invalid_type")


MAX_LOGPROBS = 20  # alternatives per token, as vLLM allows (OpenAI's completions allow 5, its chat 20)


def set_logprobs(sampling: dict[str, Any], count: int | None, param: str) -> None:
    if count is None:
        return
    if not 0 <= count <= MAX_LOGPROBS:
        raise BadRequest(f"'{param}' must be between 0 and {MAX_LOGPROBS}, got {count}", param=param)
    sampling["logprobs"] = count


def parse_messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list", param="messages",
                         code="invalid_type")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", param="messages",
                             code="invalid_type")
        content = message.get("content", "")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", param="messages")
            if not all(isinstance(t, str) for t in texts):
                raise BadRequest(f"messages[{i}].content: a text part's 'text' must be a string", param="messages",
                                 code="invalid_type")
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", param="messages", code="invalid_type")
        parsed.append({"role": message["role"], "content": content} | _tool_fields(message, i))
    return parsed


def _tool_fields(message: dict, i: int) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` (each a function call with JSON-text arguments) and a tool message's
    ``tool_call_id`` / ``name``, checked; the chat template renders them (``tool_calls.render_messages``)."""
    fields: dict[str, Any] = {}
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise BadRequest(f"messages[{i}].{key} must be a string", param="messages", code="invalid_type")
            fields[key] = message[key]
    calls = message.get("tool_calls")
    if calls is None:
        return fields
    if message["role"] != "assistant" or not isinstance(calls, list):
        raise BadRequest(f"messages[{i}].tool_calls must be a list, on an assistant message", param="messages")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", "{}"), (str, dict)):
            raise BadRequest(f"messages[{i}].tool_calls: each needs function.name and function.arguments (a JSON "
                             "string)", param="messages")
    fields["tool_calls"] = calls
    return fields


def parse_chat(body: Any) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = _require_model(body)
    messages = parse_messages(body)
    flags = _stream_flags(body)
    sampling = parse_sampling(body, ("max_completion_tokens", "max_tokens"))
    n, best_of = parse_choices(body, flags["stream"], sampling)
    if sampling.get("max_tokens") == 0:
        raise BadRequest("'max_tokens' must be at least 1, got 0", param="max_tokens")
    wants = check_type(body, "logprobs", (bool,), "a boolean")
    top = integer(body, "top_logprobs")
    if top is not None and not wants:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if wants:
        set_logprobs(sampling, top or 0, "top_logprobs")
    parallel = check_type(body, "parallel_tool_calls", (bool,), "a boolean")
    return ParsedRequest("chat", model, messages=messages, sampling=sampling, stop=parse_stop(body), n=n,
                         best_of=best_of, parallel_tool_calls=parallel is not False,
                         template=_parse_template_options(body, messages), **flags, **_extras(body))


def _optional_model(body: Any) -> str:
    """The body of a request whose ``model`` may be left out (tokenize, detokenize): that model, or ""."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model", code="invalid_type")
    return model or ""


def parse_tokenize(body: Any) -> ParsedRequest:
    """vLLM's ``/tokenize``: a completions ``prompt`` (one string) or chat ``messages``; ``model`` optional."""
    model = _optional_model(body)
    if "messages" in body:
        messages = parse_messages(body)
        return ParsedRequest("chat", model, messages=messages, template=_parse_template_options(body, messages))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' (a string) or 'messages' is required", param="prompt", code="invalid_type")
    return ParsedRequest("completion", model, prompts=[prompt])


def parse_detokenize(body: Any, vocab_size: int) -> tuple[str, list[int]]:
    """vLLM's ``/detokenize``: ``tokens``, a list of ids in the vocabulary; ``model`` optional."""
    model = _optional_model(body)
    tokens = body.get("tokens")
    if tokens != [] and not _is_token_ids(tokens):
        raise BadRequest("'tokens' must be a list of token ids", param="tokens", code="invalid_type")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"token ids out of range [0, {vocab_size}): {bad[:5]}", param="tokens")
    return model, tokens


def eos_token_ids(tokenizer: Any, engine: Any = None) -> frozenset[int]:
    for owner in (tokenizer, engine):
        for name in ("eos_token_ids", "eos_ids", "eos_token_id"):
            value = getattr(owner, name, None)
            if value is not None:
                return frozenset([value] if isinstance(value, int) else value)
    return frozenset()
