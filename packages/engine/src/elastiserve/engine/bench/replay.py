"""Replay a request stream against an in-process engine (the `LLMEngine` surface), timing every output token.

Open loop: each request is added at its arrival offset (the loop checks between steps, so a slow step delays
admission and the delay counts in TTFT, as in a real server). Closed loop (``concurrency=N``): a request starts as soon
as fewer than N are in flight. Engine stats are sampled after every step for timelines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastiserve.control.metrics import RequestRecord
from elastiserve.control.workloads import Request
from elastiserve.engine.async_engine import BACKGROUND_STEP_INTERVAL_S, background_work, stats_dict


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    samples: list[dict[str, Any]] = field(default_factory=list)  # {"t": seconds since start, **engine stats}
    events: list[dict[str, Any]] = field(default_factory=list)  # engine control events, "time" since start
    duration: float = 0.0
    stats_before: dict[str, Any] = field(default_factory=dict)
    stats_after: dict[str, Any] = field(default_factory=dict)
    settle_s: float = 0.0  # idle stepping after the point until restores and promotions finished


def default_params(request: Request) -> Any:
    from elastiserve.engine.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=request.output_tokens, ignore_eos=True)


def _metric(metrics: Any, name: str, default: int = 0) -> Any:
    return default if metrics is None else getattr(metrics, name, default)


def engine_events(engine: Any, t0: float, since: int = 0) -> list[dict[str, Any]]:
    """The engine's control events after the first ``since``, as dicts with times relative to ``t0``."""
    log = getattr(engine, "event_log", None) or getattr(engine, "events", None)
    events = getattr(log, "events", log) or []
    return [{"time": e.time - t0, "step": e.step, "kind": e.kind, "amount": e.amount, "reason": e.reason}
            for e in list(events)[since:]]


def num_engine_events(engine: Any) -> int:
    log = getattr(engine, "event_log", None) or getattr(engine, "events", None)
    return len(getattr(log, "events", log) or [])


class _Replay:
    def __init__(self, engine: Any, requests: list[Request], prompts: list[list[int]],
                 params_for: Callable[[Request], Any], concurrency: int | None) -> None:
        self.engine, self.requests, self.prompts = engine, requests, prompts
        self.params_for, self.concurrency = params_for, concurrency
        self.order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
        self.next = 0
        self.records: dict[str, RequestRecord] = {}
        self.in_flight = 0

    def due(self, now: float) -> bool:
        if self.next >= len(self.order):
            return False
        if self.concurrency is not None:
            return self.in_flight < self.concurrency
        return self.requests[self.order[self.next]].arrival <= now

    def add(self, now: float) -> None:
        i = self.order[self.next]
        self.next += 1
        r = self.requests[i]
        arrival = now if self.concurrency is not None else r.arrival
        rid = f"bench-{r.req_id}"
        self.records[rid] = RequestRecord(r.req_id, arrival, r.prompt_tokens, r.output_tokens)
        self.engine.add_request(rid, self.prompts[i], self.params_for(r))
        self.in_flight += 1

    def take(self, outputs: list[Any], now: float) -> int:
        done = 0
        for out in outputs:
            rec = self.records.get(out.request_id)
            if rec is None:
                continue
            rec.token_times.extend([now] * len(out.new_token_ids))
            if out.finished:
                rec.finish = now
                metrics = getattr(out, "metrics", None)
                rec.preemptions = int(_metric(metrics, "preemptions"))
                rec.base_pair_reads = int(_metric(metrics, "base_token_reads"))
                rec.pair_reads = int(_metric(metrics, "attended_tokens"))
                self.in_flight -= 1
                done += 1
        return done

    def next_arrival(self) -> float | None:
        if self.next >= len(self.order) or self.concurrency is not None:
            return None
        return self.requests[self.order[self.next]].arrival


def replay_in_process(engine: Any, requests: list[Request], prompts: list[list[int]], *,
                      params_for: Callable[[Request], Any] = default_params, concurrency: int | None = None,
                      max_duration_s: float | None = None, progress: bool = False,
                      desc: str = "replay", settle_timeout_s: float = 120.0) -> ReplayResult:
    """Drive ``engine`` through ``requests``; returns per-request records (times in seconds since the start).
    Afterwards the engine settles (see `settle`), so the next sweep point starts from the same state as the first."""
    from tqdm import tqdm

    run = _Replay(engine, requests, prompts, params_for, concurrency)
    result = ReplayResult([], stats_before=stats_dict(engine.stats()))
    events_before = num_engine_events(engine)
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, leave=False)
    t0 = time.monotonic()
    now = 0.0
    while run.next < len(run.order) or engine.has_unfinished():
        now = time.monotonic() - t0
        if max_duration_s is not None and now > max_duration_s:
            break
        while run.due(now):
            run.add(now)
        busy = engine.has_unfinished()
        if busy or background_work(engine):  # an idle server still restores and promotes, as AsyncEngine does
            outputs = engine.step()
            now = time.monotonic() - t0
            bar.update(run.take(outputs, now))
            result.samples.append({"t": now, **stats_dict(engine.stats())})
            if not busy:
                time.sleep(BACKGROUND_STEP_INTERVAL_S)
        else:
            wake = run.next_arrival()
            if wake is not None:
                time.sleep(max(0.0, min(wake - now, 0.05)))
    for rid, rec in run.records.items():  # out of time: free what is still running
        if not rec.finished:
            engine.abort_request(rid)
    bar.close()
    result.duration = now
    result.records = sorted(run.records.values(), key=lambda r: r.req_id)
    result.events = engine_events(engine, t0, events_before)
    result.stats_after = stats_dict(engine.stats())
    result.settle_s = settle(engine, settle_timeout_s)
    return result


def settle(engine: Any, timeout_s: float) -> float:
    """Step the idle engine until its restores and promotions are done; returns the seconds it took. Without this a
    sweep point began where the last one stopped: on the H200, combined's rate-12 MoE point started with 28 layers
    still in FP8 from the rate-8 point.

    Idle steps sleep between them, as the server's do: the restore worker is a Python thread, and a loop of empty
    steps that never let go of the GIL starved it. On the H200 (session 6) dps restored 33 of 48 MoE layers in the
    120 s limit this way (3.4 million empty steps), against about 20 ms per layer while serving."""
    t0 = time.monotonic()
    while background_work(engine) and time.monotonic() - t0 < timeout_s:
        engine.step()
        time.sleep(BACKGROUND_STEP_INTERVAL_S)
    return time.monotonic() - t0


def measure_t_base(engine: Any, vocab_size: int, *, prompt_len: int = 32, output_len: int = 9,
                   avoid: frozenset[int] = frozenset()) -> float:
    """T_base of the joint SLO: mean time per output token of one request alone on this engine, in this run."""
    from elastiserve.engine.bench.workload import make_prompts

    solo = [Request(0, 0.0, prompt_len, output_len)]
    result = replay_in_process(engine, solo, make_prompts(solo, vocab_size, avoid=avoid, seed=12345))
    return result.records[0].tpot
