"""OpenAI-compatible HTTP server (aiohttp) over an `AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events, or one JSON body;
both with ``usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. With an API key, ``/v1/*`` needs
``Authorization: Bearer <key>`` (401 otherwise). User mistakes get HTTP 400 with an OpenAI error body; an engine
failure fails only the affected requests (500, or an error event once a stream has started).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from elastiserve.engine import protocol
from elastiserve.engine.async_engine import AsyncEngine, EngineStepFailed
from elastiserve.engine.metrics_prom import ServerMetrics
from elastiserve.engine.protocol import BadRequest, ParsedRequest, TextStream, eos_token_ids, error_body
from elastiserve.engine.tokenizer import StopChecker

log = logging.getLogger(__name__)
STATE_KEY: web.AppKey[ServerState] = web.AppKey("elastiserve_state")


def default_params_factory(**kwargs: Any) -> Any:
    from elastiserve.engine.sampling import SamplingParams

    return SamplingParams(**kwargs)


def engine_limits(engine: Any, tokenizer: Any) -> tuple[int, int]:
    """(max_model_len, vocab_size) from whatever the engine exposes."""
    config = getattr(engine, "config", None)
    max_len = getattr(engine, "max_model_len", None) or getattr(config, "max_model_len", None)
    hf_config = getattr(engine, "hf_config", None) or {}
    vocab = getattr(engine, "vocab_size", None) or hf_config.get("vocab_size") or getattr(tokenizer, "vocab_size", None)
    if not max_len or not vocab:
        raise ValueError("the engine exposes no max_model_len / vocab_size; pass them to build_app")
    return int(max_len), int(vocab)


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


def json_error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> web.Response:
    return web.json_response(error_body(message, kind, param, code), status=status)


@web.middleware
async def errors_and_auth(request: web.Request, handler: Callable) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    if state.api_key and request.path.startswith("/v1"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            return json_error(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
    try:
        return await handler(request)
    except BadRequest as exc:
        return json_error(400, exc.message, param=exc.param, code=exc.code)
    except (web.HTTPException, ConnectionError):  # ConnectionError: the client left mid-stream; nothing to answer
        raise
    except EngineStepFailed as exc:
        state.metrics.count("requests_failed_total")
        return json_error(500, str(exc), kind="internal_server_error")
    except Exception as exc:  # a bug must answer this request with a JSON 500, not take the server down
        log.exception("unhandled error in %s %s", request.method, request.path)
        state.metrics.count("requests_failed_total")
        return json_error(500, f"internal error: {type(exc).__name__}: {exc}", kind="internal_server_error")


async def read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from exc


def prompt_ids_of(state: ServerState, req: ParsedRequest) -> list[int]:
    if req.kind == "chat":
        try:  # templates reject some conversations (roles out of order, ...) with a ValueError
            rendered = state.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
        except ValueError as exc:
            raise BadRequest(f"cannot apply the chat template: {exc}", param="messages") from exc
        return list(rendered) if not isinstance(rendered, str) else list(state.tokenizer.encode(rendered))
    if isinstance(req.prompt, list):
        bad = [t for t in req.prompt if not 0 <= t < state.vocab_size]
        if bad:
            raise BadRequest(f"prompt token ids out of range [0, {state.vocab_size}): {bad[:5]}", param="prompt")
        return list(req.prompt)
    return list(state.tokenizer.encode(req.prompt))


def make_params(state: ServerState, req: ParsedRequest, prompt_len: int) -> Any:
    if req.model != state.model_name:
        raise BadRequest(f"model {req.model!r} does not exist; this server serves {state.model_name!r}",
                         param="model", code="model_not_found")
    if prompt_len == 0:
        raise BadRequest("the prompt is empty", param="prompt")
    if prompt_len + req.max_tokens > state.max_model_len:
        raise BadRequest(f"this model's maximum context length is {state.max_model_len} tokens; the request has "
                         f"{prompt_len} prompt tokens and asks for {req.max_tokens} more", param="max_tokens",
                         code="context_length_exceeded")
    try:
        params = state.params_factory(**req.sampling, stop=req.stop)
        if hasattr(params, "validate"):
            params.validate(state.vocab_size, state.max_model_len, prompt_len)
    except (ValueError, TypeError) as exc:  # InvalidRequest is a ValueError
        raise BadRequest(str(exc)) from exc
    return params


class RequestRun:
    """Timing, text and stop handling of one request as its outputs arrive."""

    def __init__(self, state: ServerState, req: ParsedRequest, prompt_len: int) -> None:
        self.state, self.req, self.prompt_len = state, req, prompt_len
        self.text = TextStream(state.tokenizer, state.eos_ids)
        self.stops = StopChecker(req.stop)
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.queue_s: float | None = None
        self.pending_logprobs: list[Any] = []  # TokenLogprobs not yet sent
        self.prompt_logprobs_taken = False  # an echoed stream sends the prompt's with the echo chunk
        self.text_offset = 0  # completions' logprobs: where the next token's text starts in the choice's text

    def feed(self, output: Any) -> str:
        """New text that is safe to send; sets ``finish_reason`` when the request ends (engine or stop string)."""
        now = time.perf_counter()
        new_ids = list(output.new_token_ids)
        self.take_prompt(output)
        self.pending_logprobs += getattr(output, "logprobs", None) or []
        if new_ids:
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
            self.num_output_tokens += len(new_ids)
        if self.queue_s is None:
            self.queue_s = queue_time(getattr(output, "metrics", None))
        delta = self.text.add(new_ids, final=bool(output.finished))
        text, stopped = self.stops.feed(delta, final=bool(output.finished))
        if stopped:
            self.finish_reason = "stop"
        elif output.finished:
            self.finish_reason = output.finish_reason or "stop"
            if self.finish_reason == "abort":
                self.finish_reason = "stop"
        return text

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
        body = protocol.logprobs_body(self.req, self.pending_logprobs, lambda token_id: decode([token_id]),
                                      self.text_offset)
        if body is not None and "tokens" in body:
            self.text_offset += sum(len(t) for t in body["tokens"])
        self.pending_logprobs = []
        return body

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
    prompt_ids = prompt_ids_of(state, req)
    params = make_params(state, req, len(prompt_ids))
    request_id = protocol.new_id(req.kind)
    state.metrics.count("requests_total")
    run = RequestRun(state, req, len(prompt_ids))
    outputs = state.engine.generate(request_id, prompt_ids, params)
    async with contextlib.aclosing(outputs):
        try:
            first = await anext(outputs)  # add_request errors surface here, before any byte is sent
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc)) from exc
        if req.stream:
            return await stream_response(request, run, request_id, first, outputs)
        pieces = [prompt_text(state, req)] if req.echo else []
        output = first
        while True:
            pieces.append(run.feed(output))
            if run.finish_reason is not None:
                break
            output = await anext(outputs)
    run.record()
    body = protocol.full_body(req, request_id, "".join(pieces), run.finish_reason, run.prompt_len,
                              run.num_output_tokens, run.take_logprobs())
    return web.json_response(body)


def prompt_text(state: ServerState, req: ParsedRequest) -> str:
    return req.prompt if isinstance(req.prompt, str) else state.tokenizer.decode(list(req.prompt or []))


async def stream_response(request: web.Request, run: RequestRun, request_id: str, first: Any,
                          outputs: Any) -> web.StreamResponse:
    req, state = run.req, run.state
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = int(time.time())
    if req.kind == "chat":
        await response.write(sse(protocol.chunk_body(req, request_id, created, "", None, first=True)))
    elif req.echo:
        run.take_prompt(first)  # the first output carries the prompt's logprobs: they go with the prompt's text
        await response.write(sse(protocol.chunk_body(req, request_id, created, prompt_text(state, req), None,
                                                     logprobs=run.take_logprobs())))
    output = first
    try:
        while True:
            text = run.feed(output)
            if text:
                await response.write(sse(protocol.chunk_body(req, request_id, created, text, None,
                                                             logprobs=run.take_logprobs())))
            if run.finish_reason is not None:
                break
            output = await anext(outputs)
    except EngineStepFailed as exc:
        state.metrics.count("requests_failed_total")
        await response.write(sse(error_body(str(exc), "internal_server_error")))
        await response.write(b"data: [DONE]\n\n")
        return response
    except (ConnectionError, asyncio.CancelledError):
        state.metrics.count("requests_aborted_total")
        raise
    await response.write(sse(protocol.chunk_body(req, request_id, created, None, run.finish_reason,
                                                 logprobs=run.take_logprobs())))
    if req.include_usage:
        await response.write(sse(protocol.usage_chunk(req, request_id, created, run.prompt_len,
                                                      run.num_output_tokens)))
    await response.write(b"data: [DONE]\n\n")
    run.record()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, protocol.parse_completion(await read_json(request)))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, protocol.parse_chat(await read_json(request)))


async def models(request: web.Request) -> web.Response:
    return web.json_response(protocol.models_body([request.app[STATE_KEY].model_name]))


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if not state.engine.is_running:
        return json_error(503, "the engine thread is not running", kind="internal_server_error")
    return web.json_response({"status": "ok", "in_flight": state.engine.num_in_flight,
                              "step_errors": state.engine.step_errors})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    extra = {"requests_in_flight": state.engine.num_in_flight, "engine_step_errors": state.engine.step_errors}
    text = state.metrics.render(state.engine.last_stats, extra)
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


def build_app(engine: AsyncEngine, tokenizer: Any, *, model_name: str, api_key: str | None = None,
              max_model_len: int | None = None, vocab_size: int | None = None,
              params_factory: Callable[..., Any] = default_params_factory) -> web.Application:
    """The aiohttp application; the caller owns ``engine`` (start it before serving, shut it down after)."""
    if max_model_len is None or vocab_size is None:
        found_len, found_vocab = engine_limits(engine.engine, tokenizer)
        max_model_len, vocab_size = max_model_len or found_len, vocab_size or found_vocab
    app = web.Application(middlewares=[errors_and_auth], client_max_size=64 * 1024 * 1024)
    app[STATE_KEY] = ServerState(engine, tokenizer, model_name, max_model_len, vocab_size, api_key,
                                 params_factory, eos_ids=eos_token_ids(tokenizer, engine.engine))
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start_site(app: web.Application, host: str = "127.0.0.1", port: int = 8000) -> tuple[web.AppRunner, int]:
    """Start serving ``app``; returns the runner and the bound port (``port=0`` picks a free one)."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the request in the engine.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if port == 0 else port  # type: ignore[union-attr]
    return runner, bound


def run_forever(app: web.Application, host: str, port: int) -> None:
    async def main() -> None:
        runner, bound = await start_site(app, host, port)
        log.info("serving on http://%s:%d", host, bound)
        print(f"elastiserve: serving on http://{host}:{bound}/v1", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


class BackgroundServer:
    """Serve an app from a thread with its own event loop (tests, in-process HTTP benchmarks)."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"server-{uuid.uuid4().hex[:6]}",
                                        daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        self._runner, self.port = asyncio.run_coroutine_threadsafe(
            start_site(self.app, self.host, self.port), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"
