"""Replay a request stream against a running OpenAI-compatible server (streaming ``/v1/completions``).

Token times are the arrival times of streamed chunks: a chunk that carries several tokens (a held-back multi-byte
character, a stop-string prefix) counts as one token time, so prompts made of random ids are best (`make_prompts`).
The count of output tokens comes from the final ``usage``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from elastiserve.control.metrics import RequestRecord
from elastiserve.control.workloads import Request
from elastiserve.engine.bench.replay import ReplayResult


async def _one(session: Any, url: str, model: str, request: Request, prompt: list[int], record: RequestRecord,
               t0: float, headers: dict[str, str]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": request.output_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            record.finish = None
            return
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            now = time.perf_counter() - t0
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                record.token_times.append(now)
            if chunk.get("usage"):
                record.output_tokens = chunk["usage"]["completion_tokens"]
    record.finish = time.perf_counter() - t0


async def replay_http(url: str, model: str, requests: list[Request], prompts: list[list[int]], *,
                      api_key: str | None = None, concurrency: int | None = None, progress: bool = False,
                      timeout_s: float = 3600.0) -> ReplayResult:
    import aiohttp
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    records = [RequestRecord(r.req_id, r.arrival, r.prompt_tokens, r.output_tokens) for r in requests]
    bar = tqdm(total=len(requests), desc="http replay", disable=not progress, leave=False)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    t0 = time.perf_counter()

    async def launch(session: Any, i: int) -> None:
        if gate is None:
            await asyncio.sleep(max(0.0, requests[i].arrival - (time.perf_counter() - t0)))
            await _one(session, url, model, requests[i], prompts[i], records[i], t0, headers)
        else:
            async with gate:
                records[i].arrival = time.perf_counter() - t0
                await _one(session, url, model, requests[i], prompts[i], records[i], t0, headers)
        bar.update(1)

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(launch(session, i) for i in range(len(requests))))
    bar.close()
    return ReplayResult(records, duration=time.perf_counter() - t0)
