"""One completion or chat request on the server: prompt and parameters checked, the engine request(s) run, and the
answer written as one JSON body or as server-sent events. With ``n`` > 1 the choices are ``n`` engine requests (seeds
``seed``, ``seed + 1``, ... when a seed is given) that run side by side; their chunks interleave in a stream, each
with its choice index, and a client that leaves aborts all of them. With prefix caching the later choices wait for
the first's prefill and take the prompt's pairs from the cache (``LLMEngine.add_request``'s ``prefix_leader``).
``best_of`` > ``n`` runs ``best_of`` candidates the same way (never streamed), each scoring its sampled tokens
(``logprobs`` 0 when the client asked for none), and answers with the ``n`` of the highest mean log-probability per
token; usage counts every candidate's tokens, as OpenAI bills them. A batch of completions prompts runs each prompt's
candidates the same way, all at once; prompt ``p``'s choices take indices ``p * n`` on, and usage counts every
prompt's tokens once. A chat stream with tools sends each call as it is generated (``tool_calls.ToolCallStream``):
its start, then its arguments in fragments, each delta a chunk of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from elastiserve.engine import responses, tool_calls
from elastiserve.engine.async_engine import AsyncEngine, EngineStepFailed
from elastiserve.engine.chat_render import render_chat
from elastiserve.engine.metrics_prom import ServerMetrics
from elastiserve.engine.protocol import BadRequest, ParsedRequest, error_body
from elastiserve.engine.reasoning import ReasoningFormat, ReasoningStream, attach_reasoning
from elastiserve.engine.tokenizer import StopChecker, TextStream

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


class RequestRun:
    """Timing, text and stop handling of one request as its outputs arrive."""

    def __init__(self, state: ServerState, req: ParsedRequest, prompt_len: int, index: int = 0,
                 prompt_index: int = 0) -> None:
        self.state, self.req, self.prompt_len, self.index = state, req, prompt_len, index
        self.prompt_index = prompt_index  # which prompt of a batch this run continues
        self.text = TextStream(state.tokenizer, state.eos_ids)
        self.stops = StopChecker(req.stop)
        self.tool_stream = tool_calls.ToolCallStream(req.tools) if req.tools is not None and req.stream else None
        chat_stream = req.kind == "chat" and req.stream
        self.reasoning = ReasoningStream(state.reasoning) if chat_stream and state.reasoning is not None else None
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.queue_s: float | None = None
        self.pending_logprobs: list[Any] = []  # TokenLogprobs not yet sent
        self.prompt_logprobs_taken = False  # an echoed stream sends the prompt's with the echo chunk
        self.text_offset = 0  # completions' logprobs: where the next token's text starts in the choice's text
        self.sum_logprob = 0.0  # of the tokens fed, under the raw distribution (best_of's ranking)
        self.scored_tokens = 0

    def feed(self, output: Any) -> str:
        """New text that is safe to send; sets ``finish_reason`` when the request ends (engine or stop string)."""
        now = time.perf_counter()
        new_ids = list(output.new_token_ids)
        self.take_prompt(output)
        new_logprobs = getattr(output, "logprobs", None) or []
        self.pending_logprobs += new_logprobs
        for entry in new_logprobs:
            if entry.logprob is not None:
                self.sum_logprob += entry.logprob
                self.scored_tokens += 1
        if new_ids:
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
            self.num_output_tokens += len(new_ids)
        if self.queue_s is None:
            self.queue_s = queue_time(getattr(output, "metrics", None))
        delta = self.text.add(new_ids, final=bool(output.finished))
        if self.num_output_tokens < self.req.sampling.get("min_tokens", 0) and not output.finished:
            return delta  # vLLM's min_tokens: no stop string counts before it (the engine ignores them too)
        text, stopped = self.stops.feed(delta, final=bool(output.finished))
        if stopped:
            self.finish_reason = "stop"
        elif output.finished:
            self.finish_reason = output.finish_reason or "stop"
            if self.finish_reason == "abort":
                self.finish_reason = "stop"
        return text

    @property
    def mean_logprob(self) -> float:
        """Log-probability per scored token: OpenAI's "best" of ``best_of`` (an empty candidate ranks last)."""
        return self.sum_logprob / self.scored_tokens if self.scored_tokens else float("-inf")

    def take_prompt(self, output: Any) -> None:
        """Queue the prompt's logprobs (echo with logprobs) ahead of the generated tokens', once."""
        prompt = getattr(output, "prompt_logprobs", None)
        if prompt and not self.prompt_logprobs_taken:
            self.pending_logprobs += prompt
            self.prompt_logprobs_taken = True

    def take_logprobs(self) -> dict | None:
        """The logprobs object of the tokens fed since the last call (None if there are none or none were asked)."""
        if not self.pending_logprobs:
            return None
        decode = self.state.tokenizer.decode
        body = responses.logprobs_body(self.req, self.pending_logprobs, lambda token_id: decode([token_id]),
                                      self.text_offset)
        if body is not None and "tokens" in body:
            self.text_offset += sum(len(t) for t in body["tokens"])
        self.pending_logprobs = []
        return body

    @property
    def splits_output(self) -> bool:
        """Whether the stream's text goes out as deltas of reasoning, content and tool calls, not plain text."""
        return self.tool_stream is not None or self.reasoning is not None

    def split(self, text: str) -> list[dict[str, Any]]:
        """The chunk deltas of new ``text`` (all that is left once the request has finished): reasoning first split
        from content, then content read for tool calls."""
        final = self.finish_reason is not None
        pieces = self.reasoning.feed(text) if self.reasoning is not None else [{"content": text}]
        if final and self.reasoning is not None:
            pieces += self.reasoning.finish()
        if self.tool_stream is None:
            return pieces
        deltas = []
        for piece in pieces:
            deltas += self.tool_stream.feed(piece["content"]) if "content" in piece else [piece]
        return deltas + (self.tool_stream.finish() if final else [])

    def record(self) -> None:
        m = self.state.metrics
        ttft = self.first_token_at - self.start if self.first_token_at else None
        tpot = None
        if self.num_output_tokens > 1 and self.first_token_at and self.last_token_at:
            tpot = (self.last_token_at - self.first_token_at) / (self.num_output_tokens - 1)
        m.observe_request(ttft_s=ttft, tpot_s=tpot, queue_s=self.queue_s, e2e_s=time.perf_counter() - self.start,
                          prompt_tokens=self.prompt_len, output_tokens=self.num_output_tokens)


def queue_time(metrics: Any) -> float | None:
    """Seconds from arrival to first scheduling, from a ``SequenceMetrics`` (None until it was scheduled)."""
    if metrics is None:
        return None
    arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
    if arrival is None or scheduled is None:
        return None
    return float(scheduled) - float(arrival)


def sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def handle_generation(request: web.Request, req: ParsedRequest) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    prompts = prompt_ids_of(state, req)
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


def best_candidates(runs: list[RequestRun], n: int) -> list[int]:
    """The indices of the ``n`` runs of the highest mean log-probability per token, best first (ties: lower index)."""
    return sorted(range(len(runs)), key=lambda i: (-runs[i].mean_logprob, i))[:n]


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


def choice_params(params: Any, index: int) -> Any:
    """Choice ``index``'s parameters: a seeded request's choices draw from seeds ``seed + index``."""
    if index == 0 or getattr(params, "seed", None) is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


async def collect(run: RequestRun, output: Any, outputs: Any) -> str:
    pieces = []
    while True:
        pieces.append(run.feed(output))
        if run.finish_reason is not None:
            return "".join(pieces)
        output = await anext(outputs)


def prompt_text(state: ServerState, req: ParsedRequest, index: int = 0) -> str:
    prompt = req.prompts[index]
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(list(prompt))


async def stream_response(request: web.Request, runs: list[RequestRun], request_id: str, firsts: list[Any],
                          outputs: list[Any], prompt_tokens: int) -> web.StreamResponse:
    req, state = runs[0].req, runs[0].state
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = int(time.time())
    for run, first in zip(runs, firsts):
        if req.kind == "chat":
            await response.write(sse(responses.chunk_body(req, request_id, created, "", None, first=True,
                                                         index=run.index)))
        elif req.echo:
            run.take_prompt(first)  # the first output carries the prompt's logprobs: they go with the prompt's text
            await response.write(sse(responses.chunk_body(req, request_id, created,
                                                         prompt_text(state, req, run.prompt_index), None,
                                                         logprobs=run.take_logprobs(), index=run.index)))
    queue: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.create_task(pump(i, first, out, queue)) for i, (first, out) in enumerate(zip(firsts, outputs))]
    try:
        remaining = len(runs)
        while remaining:
            i, output = await queue.get()
            if isinstance(output, BaseException):
                raise output
            run = runs[i]
            text = run.feed(output)
            if run.splits_output:
                await write_deltas(response, run, request_id, created, run.split(text))
            elif text:
                await response.write(sse(responses.chunk_body(req, request_id, created, text, None,
                                                             logprobs=run.take_logprobs(), index=run.index)))
            if run.finish_reason is not None:
                remaining -= 1
                reason = run.finish_reason
                if run.tool_stream is not None:
                    reason = tool_calls.finish_reason(run.tool_stream.calls, reason)
                await response.write(sse(responses.chunk_body(req, request_id, created, None, reason,
                                                             logprobs=run.take_logprobs(), index=run.index)))
    except EngineStepFailed as exc:
        state.metrics.count("requests_failed_total")
        await response.write(sse(error_body(str(exc), "internal_server_error")))
        await response.write(b"data: [DONE]\n\n")
        return response
    except (ConnectionError, asyncio.CancelledError):
        state.metrics.count("requests_aborted_total")
        raise
    finally:
        for task in pumps:  # a client that left, or a failed choice: the others stop too (and abort on the engine)
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    if req.include_usage:
        await response.write(sse(responses.usage_chunk(req, request_id, created, prompt_tokens,
                                                      sum(r.num_output_tokens for r in runs))))
    await response.write(b"data: [DONE]\n\n")
    for run in runs:
        run.record()
    return response


async def write_deltas(response: web.StreamResponse, run: RequestRun, request_id: str, created: int,
                       deltas: list[dict[str, Any]]) -> None:
    """A tool-using choice's deltas (content, a call's start, its arguments' fragments), one chunk each; the
    logprobs of the tokens so far go with the first (held-back tokens' wait for the next chunk sent)."""
    for delta in deltas:
        chunk = responses.chunk_body(run.req, request_id, created, None, None, logprobs=run.take_logprobs(),
                                    index=run.index)
        chunk["choices"][0]["delta"].update(delta)
        await response.write(sse(chunk))


async def pump(index: int, first: Any, outputs: Any, queue: asyncio.Queue) -> None:
    """Choice ``index``'s outputs into the shared queue, ending at its finished one (or an error)."""
    try:
        output = first
        await queue.put((index, output))
        while not output.finished:
            output = await anext(outputs)
            await queue.put((index, output))
    except StopAsyncIteration:
        return
    except Exception as exc:  # an engine failure ends the stream; the main loop raises it
        await queue.put((index, exc))
