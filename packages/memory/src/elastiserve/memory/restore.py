"""The background restore worker: remaps stale residual chunks onto reclaimed units and copies the backup back.

It runs on its own thread with its own copy stream. Copies go in chunks (default 4 MiB) so other host-to-device
traffic can slip in between them; at most ``max_inflight_bytes`` are queued on the copy stream, so the worker can
remap the next batch on the host while the previous batch is still copying. The compute stream never waits: the
manager polls the batch's completion event between steps and only then commits the restore.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from elastiserve.memory.errors import RestoreFailed
from elastiserve.memory.sum_state import RestoreTask
from elastiserve.memory.virtual_tensor import VirtualRange

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(slots=True)
class Remap:
    range: VirtualRange
    index: int
    handle: Any


@dataclass(slots=True)
class RestoreBatch:
    """One submission: tasks of one layer, the remaps they need and the ``(dst, src)`` byte copies."""

    tasks: tuple[RestoreTask, ...]
    remaps: list[Remap]
    copies: list[tuple[torch.Tensor, torch.Tensor]]
    ready: Any = None  # an event on the compute stream the copies must wait for (in-flight KV work on the units)
    done_event: Any = None
    error: RestoreFailed | None = None
    copy_start_event: Any = None  # with ``done_event``, times the batch's copies on the GPU
    remap_seconds: dict[str, float] = field(default_factory=dict)  # host time per VMM phase (unmap/map/access)
    issued: threading.Event = field(default_factory=threading.Event)

    def finished(self) -> bool:
        if not self.issued.is_set():
            return False
        return self.error is not None or self.done_event is None or self.done_event.query()


class RestoreWorker:
    """Owns a thread and a copy stream; ``submit`` batches, ``poll`` the finished ones (in submission order)."""

    def __init__(self, device: torch.device, *, chunk_bytes: int = 4 * MiB,
                 max_inflight_bytes: int = 256 * MiB) -> None:
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        self.max_inflight_bytes = max(max_inflight_bytes, chunk_bytes)
        self._queue: queue.Queue[RestoreBatch | None] = queue.Queue()
        self._submitted: collections.deque[RestoreBatch] = collections.deque()
        self._thread = threading.Thread(target=self._run, name="elastiserve-restore", daemon=True)
        self._thread.start()

    def submit(self, batch: RestoreBatch) -> None:
        self._submitted.append(batch)
        self._queue.put(batch)

    def pending(self) -> int:
        return len(self._submitted)

    def all_finished(self) -> bool:
        """Whether every submitted batch's copies have landed (TP ranks agree on this before committing)."""
        return all(batch.finished() for batch in self._submitted)

    def poll(self) -> list[RestoreBatch]:
        done = []
        while self._submitted and self._submitted[0].finished():
            done.append(self._submitted.popleft())
        return done

    def drain(self, timeout: float | None = None) -> None:
        """Block until every submitted batch has finished (tests, shutdown); the serving path uses ``poll``."""
        for batch in list(self._submitted):
            batch.issued.wait(timeout)
            if batch.done_event is not None and batch.error is None:
                batch.done_event.synchronize()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        inflight: collections.deque[tuple[Any, int]] = collections.deque()
        while (batch := self._queue.get()) is not None:
            try:
                remap(batch.remaps, batch.remap_seconds)
                batch.done_event = self._copy(batch, stream, inflight)
            except Exception as exc:  # any failure aborts the batch; the manager keeps those layers in FP8
                log.warning("restore of %d residual chunks failed: %s", len(batch.tasks), exc)
                batch.error = RestoreFailed(f"restore of {[t.chunk for t in batch.tasks]} failed: {exc}")
                batch.error.__cause__ = exc
                self._quiesce(stream)
            finally:
                batch.issued.set()

    @staticmethod
    def _quiesce(stream: Any) -> None:
        """After a failure no copy of the batch may still be landing: its units go back to KV when it aborts."""
        if stream is None:
            return
        try:
            stream.synchronize()
        except Exception:  # a sticky device error; the caller's next CUDA call reports it
            log.exception("copy stream did not drain after a failed restore")

    def _copy(self, batch: RestoreBatch, stream: Any, inflight: collections.deque) -> Any:
        if stream is None:
            for dst, src in batch.copies:
                for start in range(0, dst.numel(), self.chunk_bytes):
                    dst[start:start + self.chunk_bytes].copy_(src[start:start + self.chunk_bytes])
            return None
        with torch.cuda.stream(stream):
            if batch.ready is not None:
                stream.wait_event(batch.ready)
            batch.copy_start_event = torch.cuda.Event(enable_timing=True)
            batch.copy_start_event.record(stream)
            for dst, src in batch.copies:
                for start in range(0, dst.numel(), self.chunk_bytes):
                    piece = dst[start:start + self.chunk_bytes]
                    piece.copy_(src[start:start + self.chunk_bytes], non_blocking=True)
                    inflight.append((stream.record_event(), piece.numel()))
                    self._bound_inflight(inflight)
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
            return done

    def _bound_inflight(self, inflight: collections.deque) -> None:
        queued = sum(n for _, n in inflight)
        while queued > self.max_inflight_bytes:
            event, n = inflight.popleft()
            event.synchronize()  # blocks this worker thread only
            queued -= n
        while inflight and inflight[0][0].query():
            inflight.popleft()


def _runs(steps: list[Remap]) -> list[list[Remap]]:
    """Group steps into runs of consecutive slots of one range."""
    runs: list[list[Remap]] = []
    for step in sorted(steps, key=lambda s: (id(s.range), s.index)):
        if runs and runs[-1][-1].range is step.range and runs[-1][-1].index + 1 == step.index:
            runs[-1].append(step)
        else:
            runs.append([step])
    return runs


def remap(remaps: list[Remap], seconds: dict[str, float] | None = None) -> None:
    """Point each residual slot at its new handle: unmap each run of slots with one call, map unit by unit, then
    grant access once per run (per-call driver overhead dominates at 2 MiB units)."""
    seconds = {} if seconds is None else seconds
    changed = [step for step in remaps if step.range.handle_at(step.index) is not step.handle]
    runs = _runs(changed)
    start = time.perf_counter()
    for run in runs:
        run[0].range.unmap_units(run[0].index, len(run))
    mapped = time.perf_counter()
    for step in changed:
        step.range.map_unit(step.index, step.handle, set_access=False)
    accessed = time.perf_counter()
    for run in runs:
        run[0].range.set_access(run[0].index, len(run))
    seconds.update(unmap=mapped - start, map=accessed - mapped, set_access=time.perf_counter() - accessed)
