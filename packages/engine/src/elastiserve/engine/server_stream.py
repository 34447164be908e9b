"""A request's answer as server-sent events: each choice's chunks as its outputs arrive (interleaved, each with its
choice index), the deltas of reasoning, content and tool calls where the choice splits its text, the usage chunk,
and ``[DONE]``. A client that leaves (or a failed choice) stops every choice, which aborts them on the engine."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from elastiserve.engine import responses, tool_calls
from elastiserve.engine.async_engine import EngineStepFailed
from elastiserve.engine.request_fields import error_body
from elastiserve.engine.request_run import RequestRun, prompt_text


def sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def stream_response(request: web.Request, runs: list[RequestRun], request_id: str, firsts: list[Any],
                          outputs: list[Any], prompt_tokens: int) -> web.StreamResponse:
    req, state = runs[0].req, runs[0].state
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = int(time.time())

    async def send(chunk: dict[str, Any]) -> None:
        if req.include_usage and req.continuous_usage:  # vLLM's continuous_usage_stats: the tokens so far
            chunk["usage"] = responses.usage(prompt_tokens, sum(r.num_output_tokens for r in runs))
        await response.write(sse(chunk))

    for run, first in zip(runs, firsts):
        if req.kind == "chat":
            await send(responses.chunk_body(req, request_id, created, "", None, first=True, index=run.index))
        elif req.echo:
            run.take_prompt(first)  # the first output carries the prompt's logprobs: they go with the prompt's text
            await send(responses.chunk_body(req, request_id, created, prompt_text(state, req, run.prompt_index),
                                            None, logprobs=run.take_logprobs(), index=run.index))
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
                await write_deltas(send, run, request_id, created, run.split(text))
            elif text:
                await send(responses.chunk_body(req, request_id, created, text, None, logprobs=run.take_logprobs(),
                                                index=run.index))
            if run.finish_reason is not None:
                remaining -= 1
                reason = run.finish_reason
                if run.tool_stream is not None:
                    reason = tool_calls.finish_reason(run.tool_stream.calls, reason)
                await send(responses.chunk_body(req, request_id, created, None, reason, logprobs=run.take_logprobs(),
                                                index=run.index))
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


async def write_deltas(send: Callable[[dict[str, Any]], Awaitable[None]], run: RequestRun, request_id: str,
                       created: int, deltas: list[dict[str, Any]]) -> None:
    """A splitting choice's deltas (reasoning, content, a call's start, its arguments' fragments), one chunk each;
    the logprobs of the tokens so far go with the first (held-back tokens' wait for the next chunk sent)."""
    for delta in deltas:
        chunk = responses.chunk_body(run.req, request_id, created, None, None, logprobs=run.take_logprobs(),
                                    index=run.index)
        chunk["choices"][0]["delta"].update(delta)
        await send(chunk)


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
