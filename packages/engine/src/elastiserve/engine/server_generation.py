"""One completion or chat request on the server: prompt and parameters checked, the engine request(s) run, and the
answer written as one JSON body or as server-sent events. With ``n`` > 1 the choices are ``n`` engine requests (seeds
``seed``, ``seed + 1``, ... when a seed is given) that run side by side; their chunks interleave in a stream, each
with its choice index, and a client that leaves aborts all of them. With prefix caching the later choices wait for
the first's prefill and take the prompt's pairs from the cache (``LLMEngine.add_request``'s ``prefix_leader``).
``best_of`` > ``n`` runs ``best_of`` candidates the same way (never streamed), each scoring its sampled tokens
(``logprobs`` 0 when the client asked for none), and answers with the ``n`` of the highest mean log-probability per
token; usage counts every candidate's tokens, as OpenAI bills them. A batch of completions prompts runs each prompt's
candidates the same way, all at once; prompt ``p``'s choices take indices ``p * n`` on, and usage counts every
prompt's tokens once. Each choice's text is read as it arrives by a ``request_run.RequestRun``; streams are written
by ``server_stream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from elastiserve.engine import responses, tool_calls
from elastiserve.engine.async_engine import AsyncEngine
from elastiserve.engine.chat_render import render_chat
from elastiserve.engine.metrics_prom import ServerMetrics
from elastiserve.engine.protocol import ParsedRequest
from elastiserve.engine.reasoning import ReasoningFormat, attach_reasoning
from elastiserve.engine.request_fields import BadRequest
from elastiserve.engine.request_run import RequestRun, prompt_text
from elastiserve.engine.sampling import best_candidates, choice_params
from elastiserve.engine.server_stream import stream_response

STATE_KEY: web.AppKey[ServerState] = web.AppKey("elastiserve_state")


def default_params_factory(**kwargs: Any) -> Any:
    from elastiserve.engine.sampling import SamplingParams

    return SamplingParams(**kwargs)


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    params_factory: Callable[..., Any] = default_params_factory
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    eos_ids: frozenset[int] = frozenset()
    reasoning: ReasoningFormat | None = None  # --reasoning-parser: chat answers' reasoning split from content
    default_sampling: dict[str, Any] = field(default_factory=dict)  # generation_defaults: under each request's own
    max_sequence_tokens: int | None = None  # prompt + output one request may hold (the engine's KV pool), if known


def prompt_ids_of(state: ServerState, req: ParsedRequest) -> list[list[int]]:
    """The token ids of each prompt: chat's one rendered conversation, or completions' prompt(s)."""
    if req.kind == "chat":
        messages, extra = tool_calls.render_messages(req.messages, req.tools, state.tokenizer)
        rendered = render_chat(state.tokenizer, messages, req.template, extra)
        return [list(rendered) if not isinstance(rendered, str) else list(state.tokenizer.encode(rendered))]
    prompts = []
    for prompt in req.prompts:
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < state.vocab_size]
            if bad:
                raise BadRequest(f"prompt token ids out of range [0, {state.vocab_size}): {bad[:5]}", param="prompt")
            prompts.append(list(prompt))
        else:
            prompts.append(list(state.tokenizer.encode(prompt)))
    return prompts


def truncated(state: ServerState, req: ParsedRequest, ids: list[int]) -> list[int]:
    """The prompt's last ``truncate_prompt_tokens`` tokens (-1: the context's length), as vLLM keeps them."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return ids
    keep = state.max_model_len if keep == -1 else keep
    if keep > state.max_model_len:
        raise BadRequest(f"'truncate_prompt_tokens' ({keep}) is over the model's context length "
                         f"({state.max_model_len})", param="truncate_prompt_tokens")
    return ids[-keep:]


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise BadRequest(f"model {model!r} does not exist; this server serves {state.model_name!r}", param="model",
                         code="model_not_found")


def make_params(state: ServerState, req: ParsedRequest, prompt_len: int) -> Any:
    """The request's sampling parameters over the server's defaults (``generation_defaults``). A chat request that
    sets no max_tokens may use the rest of the context, as in vLLM (the default's max_tokens capped there);
    completions keep OpenAI's 16."""
    check_model(state, req.model)
    if prompt_len == 0:
        raise BadRequest("the prompt is empty", param="prompt")
    sampling = {**state.default_sampling, **req.sampling}
    if "max_tokens" not in req.sampling and req.kind == "chat":
        room = min(state.max_model_len, state.max_sequence_tokens or state.max_model_len) - prompt_len
        sampling["max_tokens"] = min(sampling.get("max_tokens", room), room)
    max_tokens = sampling.setdefault("max_tokens", 16)
    if prompt_len + max_tokens > state.max_model_len or (req.kind == "chat" and max_tokens < 1):  # no room left
        raise BadRequest(f"this model's maximum context length is {state.max_model_len} tokens; the request has "
                         f"{prompt_len} prompt tokens and asks for {max(max_tokens, 1)} more", param="max_tokens",
                         code="context_length_exceeded")
    try:
        params = state.params_factory(**sampling, stop=req.stop)
        if hasattr(params, "validate"):
            params.validate(state.vocab_size, state.max_model_len, prompt_len)
    except (ValueError, TypeError) as exc:  # InvalidRequest is a ValueError
        raise BadRequest(str(exc)) from exc
    return params


async def handle_generation(request: web.Request, req: ParsedRequest) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    prompts = [truncated(state, req, ids) for ids in prompt_ids_of(state, req)]
    params = [make_params(state, req, len(ids)) for ids in prompts]
    request_id = responses.new_id(req.kind)
    state.metrics.count("requests_total")
    ranked = req.best_of > req.n
    if ranked and getattr(params[0], "logprobs", 0) is None:  # score the sampled tokens only (no alternatives)
        params = [dataclasses.replace(p, logprobs=0) for p in params]
    runs, starts = [], []  # one run per candidate, prompt by prompt; starts: its engine request's arguments
    for p, ids in enumerate(prompts):
        names = engine_ids(request_id, p, len(prompts), req.best_of)
        for i, name in enumerate(names):
            # the candidate's number, which is its choice index wherever nothing is ranked (every stream)
            runs.append(RequestRun(state, req, len(ids), index=p * req.best_of + i, prompt_index=p))
            starts.append((name, ids, choice_params(params[p], i), None if i == 0 else names[0]))
    prompt_tokens = sum(len(ids) for ids in prompts)
    async with contextlib.AsyncExitStack() as stack:
        outputs = [await stack.enter_async_context(contextlib.aclosing(state.engine.generate(
            name, ids, choice, prefix_leader=leader, priority=req.priority))) for name, ids, choice, leader in starts]
        try:  # add_request errors surface here, before any byte is sent; all choices start together
            firsts = await gather_or_cancel(anext(out) for out in outputs)
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc)) from exc
        if req.stream:
            return await stream_response(request, runs, request_id, firsts, outputs, prompt_tokens)
        texts = await gather_or_cancel(collect(run, first, out) for run, first, out in zip(runs, firsts, outputs))
    for run in runs:
        run.record()
    choices = []
    for p in range(len(prompts)):
        group = range(p * req.best_of, (p + 1) * req.best_of)
        best = best_candidates([runs[k] for k in group], req.n) if ranked else range(req.n)
        echo = prompt_text(state, req, p) if req.echo else ""
        choices += [(echo + texts[group[i]], runs[group[i]].finish_reason, runs[group[i]].take_logprobs())
                    for i in best]
    body = responses.full_body(req, request_id, choices, prompt_tokens, sum(r.num_output_tokens for r in runs))
    if req.kind == "chat" and state.reasoning is not None:
        attach_reasoning(body, state.reasoning)
    if req.tools is not None:
        tool_calls.attach_calls(body, req.tools)
    return web.json_response(body)


def engine_ids(request_id: str, prompt_index: int, num_prompts: int, count: int) -> list[str]:
    """The engine request ids of one prompt's ``count`` candidates: the response id itself for a lone one."""
    if num_prompts == 1:
        return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]
    return [f"{request_id}-{prompt_index}-{i}" for i in range(count)]


async def gather_or_cancel(coroutines: Any) -> list[Any]:
    """``asyncio.gather`` that also stops the other choices when one fails, so that none is still inside its engine
    stream when the streams are closed (and aborted) on the way out."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(run: RequestRun, output: Any, outputs: Any) -> str:
    pieces = []
    while True:
        pieces.append(run.feed(output))
        if run.finish_reason is not None:
            return "".join(pieces)
        output = await anext(outputs)
