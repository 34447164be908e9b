"""`AsyncEngine`: an `LLMEngine` stepped on one background thread, fed and read from asyncio.

Only the engine thread touches the engine. The event loop hands it work (add, abort, stats) through a queue of
closures, each answered through a `concurrent.futures.Future`; outputs travel back through one asyncio queue per request
(``loop.call_soon_threadsafe``). A step that raises fails exactly the requests in flight (their iterators raise
`EngineStepFailed`) and aborts them; the thread keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from elastiserve.platforms.errors import ElastiserveError

log = logging.getLogger(__name__)


class EngineStepFailed(ElastiserveError, RuntimeError):
    """The engine raised during a step while this request was in flight; the request was aborted."""


class EngineStopped(ElastiserveError, RuntimeError):
    """The background thread is not running (never started, or shut down)."""


# An idle engine with restores or promotions in flight steps this often: each step moves them on, and a new request
# wakes the thread at once.
BACKGROUND_STEP_INTERVAL_S = 0.002


def background_work(engine: Any) -> bool:
    check = getattr(engine, "has_background_work", None)  # engines without restores or promotions lack it
    return bool(check and check())


def stats_dict(stats: Any) -> dict[str, Any]:
    """Engine stats as a plain dict, whether the engine returns a dict or a dataclass."""
    if stats is None:
        return {}
    if isinstance(stats, dict):
        return dict(stats)
    import dataclasses

    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}


class AsyncEngine:
    """Serve one engine object (the `LLMEngine` surface) to many asyncio callers.

    ``engine`` needs ``add_request(request_id, prompt_token_ids, params)``, ``abort_request(request_id)``,
    ``step() -> list[RequestOutput]``, ``has_unfinished() -> bool`` and ``stats()``; ``add_request`` also takes
    ``prefix_leader=`` where a caller passes one (the server does for ``n`` > 1).
    """

    def __init__(self, engine: Any, *, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.step_errors = 0
        self.last_stats: dict[str, Any] = {}
        self._ops: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="elastiserve-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    # ---- calls from the event loop ---------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between steps."""
        if not self.is_running:
            raise EngineStopped("the engine thread is not running; call start() first")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._ops.append((fn, future))
        self._wake.set()
        return future

    async def call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.submit(fn))

    async def stats(self) -> dict[str, Any]:
        return stats_dict(await self.call(self.engine.stats))

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        await self.call(lambda: self._abort_quietly(request_id))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any,
                       prefix_leader: str | None = None, priority: int = 0) -> AsyncIterator[Any]:
        """Yield the request's `RequestOutput`s until one is finished.

        Leaving the iteration early (break, cancellation on client disconnect, an error while writing) aborts the
        request on the engine, which frees its blocks. ``add_request`` errors (e.g. `InvalidRequest`) propagate.
        ``prefix_leader`` and ``priority`` (``LLMEngine.add_request``) are passed on only when given.
        """
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            extra = {} if prefix_leader is None else {"prefix_leader": prefix_leader}
            if priority:
                extra["priority"] = priority
            await self.call(lambda: self.engine.add_request(request_id, prompt_token_ids, params, **extra))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread already aborted it
                    raise EngineStepFailed(f"engine step failed: {item!r}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished and self.is_running:
                self.submit(lambda: self._abort_quietly(request_id))  # fire and forget: we may be cancelled

    # ---- the engine thread -----------------------------------------------------------------------------------
    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except (KeyError, ValueError) as exc:  # already finished or never added: nothing to free
            log.debug("abort of %s ignored: %r", request_id, exc)

    def _run_ops(self) -> bool:
        with self._lock:
            ops = list(self._ops)
            self._ops.clear()
        for fn, future in ops:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
        return bool(ops)

    def _deliver(self, request_id: str, item: Any, last: bool) -> None:
        with self._lock:
            target = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if target is None:
            return  # the caller left; its abort is queued
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop closed under us
            log.debug("dropping output for %s: its event loop is closed", request_id)

    def _fail_in_flight(self, exc: BaseException) -> None:
        self.step_errors += 1
        log.exception("engine step failed; failing the requests in flight", exc_info=exc)
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._abort_quietly_any(request_id)
            self._deliver(request_id, exc, last=True)

    def _abort_quietly_any(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception as exc:  # the engine is already broken; the request must still be released
            log.warning("abort of %s after a failed step raised %r", request_id, exc)

    def _refresh_stats(self) -> None:
        try:
            self.last_stats = stats_dict(self.engine.stats())
        except Exception as exc:
            log.warning("engine.stats() raised %r", exc)

    def _run(self) -> None:
        last_refresh = 0.0
        while not self._stop.is_set():
            did_ops = self._run_ops()
            stepped = False
            busy = self.engine.has_unfinished()
            background_only = not busy and background_work(self.engine)
            if busy or background_only:
                stepped = True
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    self._fail_in_flight(exc)
                    outputs = []
                for output in outputs:
                    self._deliver(output.request_id, output, last=bool(output.finished))
            now = time.monotonic()
            if did_ops or (stepped and now - last_refresh > 0.05):
                self._refresh_stats()
                last_refresh = now
            if background_only:  # restores and promotions progress per step; a request wakes us at once
                self._wake.wait(BACKGROUND_STEP_INTERVAL_S)
                self._wake.clear()
            elif not stepped and not did_ops:
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
        self._run_ops()  # answer anything queued during shutdown
