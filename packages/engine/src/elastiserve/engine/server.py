"""OpenAI-compatible HTTP server (aiohttp) over an `AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events, or one JSON body;
both with ``usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, and vLLM's ``POST /tokenize`` and
``POST /detokenize``. With an API key, ``/v1/*`` needs
``Authorization: Bearer <key>`` (401 otherwise). User mistakes get HTTP 400 with an OpenAI error body; an engine
failure fails only the affected requests (500, or an error event once a stream has started).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from elastiserve.engine import protocol, responses, structured
from elastiserve.engine.async_engine import AsyncEngine, EngineStepFailed
from elastiserve.engine.protocol import eos_token_ids
from elastiserve.engine.reasoning import reasoning_format
from elastiserve.engine.request_fields import BadRequest, error_body
from elastiserve.engine.server_generation import (
    STATE_KEY,
    ServerState,
    check_model,
    default_params_factory,
    handle_generation,
    prompt_ids_of,
)
from elastiserve.platforms.errors import ConfigError

log = logging.getLogger(__name__)


def engine_limits(engine: Any, tokenizer: Any) -> tuple[int, int]:
    """(max_model_len, vocab_size) from whatever the engine exposes."""
    config = getattr(engine, "config", None)
    max_len = getattr(engine, "max_model_len", None) or getattr(config, "max_model_len", None)
    hf_config = getattr(engine, "hf_config", None) or {}
    vocab = getattr(engine, "vocab_size", None) or hf_config.get("vocab_size") or getattr(tokenizer, "vocab_size", None)
    if not max_len or not vocab:
        raise ValueError("the engine exposes no max_model_len / vocab_size; pass them to build_app")
    return int(max_len), int(vocab)


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
    except web.HTTPException as exc:  # aiohttp's own 404 / 405 / 413 get an OpenAI error body too
        if exc.status < 400:
            raise
        message, code = exc.text or exc.reason, None
        if exc.status == 404:
            message, code = f"unknown request URL: {request.method} {request.path}", "unknown_url"
        elif exc.status == 405:
            message, code = f"method {request.method} is not allowed on {request.path}", "method_not_allowed"
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return web.json_response(error_body(message, code=code), status=exc.status, headers=headers)
    except ConnectionError:  # the client left mid-stream; nothing to answer
        raise
    except EngineStepFailed as exc:
        state.metrics.count("requests_failed_total")
        return json_error(500, str(exc), kind="internal_server_error")
    except Exception as exc:  # a bug must answer this request with a JSON 500, not take the server down
        log.exception("unhandled error in %s %s", request.method, request.path)
        state.metrics.count("requests_failed_total")
        return json_error(500, f"internal error: {type(exc).__name__}: {exc}", kind="internal_server_error")


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:  # ValueError: also an integer past Python's digit limit; RecursionError: nesting too deep
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from exc
    try:  # what json.loads took can still be too deep for json.dumps, which runs a few frames deeper
        encodes = _encodes(body)
    except RecursionError as exc:
        raise BadRequest("the JSON body is nested too deep") from exc
    if not encodes:  # a lone surrogate escape ("\\ud800") decodes to a str that no tokenizer can encode
        field = next((k for k, v in body.items() if not _encodes({k: v})), None) if isinstance(body, dict) else None
        raise BadRequest(f"{repr(field) if field else 'the JSON body'} holds a lone UTF-16 surrogate escape (\\ud800 "
                         "to \\udfff), which is not valid Unicode", param=field, code="invalid_unicode")
    return body


def _encodes(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


async def completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, structured.parse_completion(await read_json(request)))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, structured.parse_chat(await read_json(request)))


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = protocol.parse_tokenize(await read_json(request))
    if req.model:  # optional here, as in vLLM
        check_model(state, req.model)
    tokens = prompt_ids_of(state, req)[0]
    return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    model, tokens = protocol.parse_detokenize(await read_json(request), state.vocab_size)
    if model:
        check_model(state, model)
    return web.json_response({"prompt": state.tokenizer.decode(tokens)})


async def models(request: web.Request) -> web.Response:
    return web.json_response(responses.models_body([request.app[STATE_KEY].model_name]))


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if not state.engine.is_running:
        return json_error(503, "the engine thread is not running", kind="internal_server_error")
    return web.json_response({"status": "ok", "in_flight": state.engine.num_in_flight,
                              "step_errors": state.engine.step_errors})


async def version(request: web.Request) -> web.Response:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return web.json_response({"version": package_version("elastiserve-engine")})
    except PackageNotFoundError:  # run from a source tree without installing
        return web.json_response({"version": "unknown"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    extra = {"requests_in_flight": state.engine.num_in_flight, "engine_step_errors": state.engine.step_errors}
    text = state.metrics.render(state.engine.last_stats, extra)
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


def build_app(engine: AsyncEngine, tokenizer: Any, *, model_name: str, api_key: str | None = None,
              max_model_len: int | None = None, vocab_size: int | None = None,
              params_factory: Callable[..., Any] = default_params_factory,
              reasoning_parser: str | None = None,
              default_sampling: dict[str, Any] | None = None) -> web.Application:
    """The aiohttp application; the caller owns ``engine`` (start it before serving, shut it down after).
    ``reasoning_parser``: ``qwen3`` or ``deepseek_r1`` splits chat answers' reasoning out (``engine.reasoning``);
    ``default_sampling``: sampling values a request's own override (``engine.generation_defaults``)."""
    if max_model_len is None or vocab_size is None:
        found_len, found_vocab = engine_limits(engine.engine, tokenizer)
        max_model_len, vocab_size = max_model_len or found_len, vocab_size or found_vocab
    app = web.Application(middlewares=[errors_and_auth], client_max_size=64 * 1024 * 1024)
    app[STATE_KEY] = ServerState(engine, tokenizer, model_name, max_model_len, vocab_size, api_key,
                                 params_factory, eos_ids=eos_token_ids(tokenizer, engine.engine),
                                 reasoning=reasoning_format(reasoning_parser),
                                 default_sampling=dict(default_sampling or {}),
                                 max_sequence_tokens=getattr(engine.engine, "max_sequence_tokens", None))
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)  # vLLM's, outside /v1 as there
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)  # vLLM's
    app.router.add_get("/metrics", metrics)
    return app


async def start_site(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
                     socks: list[socket.socket] | None = None) -> tuple[web.AppRunner, int]:
    """Start serving ``app`` on ``socks`` (from ``listen_sockets``) or on ``host:port``; returns the runner and the
    bound port (``port=0`` picks a free one)."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the request in the engine.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    if socks:
        for sock in socks:
            await web.SockSite(runner, sock).start()
        return runner, socks[0].getsockname()[1]
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if port == 0 else port  # type: ignore[union-attr]
    return runner, bound


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """The server's sockets, one for each address ``host`` resolves to (``localhost``: 127.0.0.1 and ::1, as
    asyncio's ``create_server`` binds them), bound before the model loads (as vLLM binds its port first), so a port
    in use or a host that does not resolve stops ``serve`` in a second with a ``ConfigError``, not after the load
    with a traceback. With ``port=0`` every address gets the port the first one drew."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, OverflowError) as exc:  # gaierror is an OSError; a port past 65535 an OverflowError
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from None
    socks: list[socket.socket] = []
    has_ipv4 = any(info[0] == socket.AF_INET for info in infos)  # a lone :: keeps the system's dual-stack default
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # a resolver may list an address twice
            if socks and port == 0:
                address = (address[0], socks[0].getsockname()[1], *address[2:])
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
            if family == socket.AF_INET6 and has_ipv4:  # :: would take IPv4 too and collide with 0.0.0.0's socket
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(1024)
    except OSError as exc:
        for sock in socks:
            sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from None
    return socks


def run_forever(app: web.Application, socks: list[socket.socket]) -> None:
    async def main() -> None:
        runner, bound = await start_site(app, socks=socks)
        for sock in socks:
            host = sock.getsockname()[0]
            url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
            log.info("serving on %s", url)
            print(f"elastiserve: serving on {url}/v1", flush=True)
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
