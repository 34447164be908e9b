"""The physical SUM manager: units, the KV virtual tensor, residual virtual tensors, restores.

Layout (ARCHITECTURE.md): ``num_units`` physical units of ``unit_bytes``, all permanently mapped, in order, into one
KV range viewed block-major with a uniform block stride; blocks straddling a unit boundary are dead. Each decoder
layer's residual gets its own range padded to whole units, each unit also mapped into the KV range (dual mapping).
The persistent region (upper/FP8 planes) is ordinary torch memory owned by the caller. Physical work happens here and
in the restore worker; the books are kept by ``SumState``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from elastiserve.memory.errors import ConfigError, PoolExhausted, RestoreFailed
from elastiserve.memory.residual_backup import ResidualBackup, one_shot_copy
from elastiserve.memory.restore import Remap, RestoreBatch, RestoreWorker
from elastiserve.memory.sum_state import AllocResult, RestoreTask, SumState
from elastiserve.memory.virtual_tensor import VirtualRange
from elastiserve.memory.vmm.base import VMMBackend

log = logging.getLogger(__name__)

MiB = 1 << 20


def dead_block_fraction(unit_bytes: int, block_bytes: int) -> float:
    """Long-run fraction of blocks lost to unit boundaries: one per boundary not on a block edge."""
    period = math.lcm(unit_bytes, block_bytes)
    return (period // unit_bytes - 1) * block_bytes / period


def every_unit_holds_a_block(unit_bytes: int, block_bytes: int) -> bool:
    """Under a uniform block stride, whether every unit wholly contains at least one block. Unit starts fall on every
    multiple g of gcd(unit, block) modulo the block size; the worst one (g past a block edge) needs
    ``block - g`` bytes to reach the next edge plus a whole block."""
    return unit_bytes >= 2 * block_bytes - math.gcd(unit_bytes, block_bytes)


def choose_unit_bytes(block_bytes: int, granularity: int, target: int = 2 * MiB) -> int:
    """The multiple of ``granularity`` in ``[block_bytes, max(target, block_bytes)]`` (rounded up to granularity)
    losing the fewest blocks to straddling, every unit holding a whole block; ties go to the size nearest ``target``.
    If no size in that range qualifies (Qwen3-30B-A3B: 1.5 MiB blocks in 2 MiB units leave every third unit
    empty), the range widens up to four blocks past it."""
    smallest = -(-max(block_bytes, granularity) // granularity)
    largest = max(smallest, -(-target // granularity))
    sizes = [k * granularity for k in range(smallest, largest + 1)]
    sizes = [u for u in sizes if every_unit_holds_a_block(u, block_bytes)] or [
        k * granularity for k in range(largest + 1, largest + 2 + -(-4 * block_bytes // granularity))
        if every_unit_holds_a_block(k * granularity, block_bytes)
    ]
    return min(sizes, key=lambda u: (round(dead_block_fraction(u, block_bytes), 12), abs(u - target)))


def unit_block_lists(num_units: int, unit_bytes: int, block_bytes: int) -> list[list[int]]:
    """Block ids wholly inside each unit under a uniform block stride; straddling blocks appear nowhere."""
    lists: list[list[int]] = [[] for _ in range(num_units)]
    for block in range(num_units * unit_bytes // block_bytes):
        first_unit = block * block_bytes // unit_bytes
        if ((block + 1) * block_bytes - 1) // unit_bytes == first_unit:
            lists[first_unit].append(block)
    return lists


@dataclass(frozen=True, slots=True)
class SumConfig:
    num_units: int
    unit_bytes: int
    block_bytes: int
    restore_chunk_bytes: int = 4 * MiB
    restore_batch_units: int = 64  # units per worker submission (one set_access per contiguous run)
    max_inflight_bytes: int = 256 * MiB

    def __post_init__(self) -> None:
        for name in ("num_units", "unit_bytes", "block_bytes", "restore_chunk_bytes", "restore_batch_units",
                     "max_inflight_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"SumConfig.{name}={getattr(self, name)} must be positive")
        if self.block_bytes > self.unit_bytes:
            raise ConfigError(f"block_bytes={self.block_bytes} exceeds unit_bytes={self.unit_bytes}")


@dataclass(frozen=True, slots=True)
class StepReport:
    committed: tuple[RestoreTask, ...]
    failed: tuple[RestoreFailed, ...]
    submitted: int
    finished_batches: tuple[RestoreBatch, ...] = ()  # for timing (remap_seconds, copy events)
    deferred: bool = False  # nothing committed or started this step (a tensor-parallel peer was still copying)


class SumManager:
    """Units, KV view, residual views and the restore loop of one device.

    Call order per step: ``alloc_blocks``/``free_blocks`` while scheduling, ``mode_for_next_step()`` when the runner
    starts the step, ``between_steps()`` after it (commits finished restores, starts new ones).
    """

    def __init__(self, backend: VMMBackend, config: SumConfig) -> None:
        granularity = backend.granularity()
        if config.unit_bytes % granularity:
            raise ConfigError(f"unit_bytes={config.unit_bytes} is not a multiple of the granularity {granularity}")
        self.backend, self.config = backend, config
        self.state = SumState(unit_block_lists(config.num_units, config.unit_bytes, config.block_bytes))
        self.num_blocks = config.num_units * config.unit_bytes // config.block_bytes
        self._handles: list[Any] = []
        try:
            self._handles = [backend.create(config.unit_bytes) for _ in range(config.num_units)]
            self.kv_range = VirtualRange(backend, config.num_units * config.unit_bytes, unit_bytes=config.unit_bytes)
            for unit, handle in enumerate(self._handles):
                self.kv_range.map_unit(unit, handle, set_access=False)
            self.kv_range.set_access(0, config.num_units)
        except Exception:
            self._release_handles()
            raise
        self._residuals: dict[int, tuple[VirtualRange, int, torch.Tensor]] = {}  # layer -> (range, nbytes, bytes)
        self.backup: ResidualBackup | None = None
        self._worker: RestoreWorker | None = None
        self.restore_failures: list[RestoreFailed] = []

    @property
    def device(self) -> torch.device:
        return self.backend.device

    # ----------------------------------------------------------------- views
    def kv_view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The block-major KV tensor ``[num_blocks, ...]``; one block's elements must fill ``block_bytes``."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if math.prod(shape[1:]) * itemsize != self.config.block_bytes or not 0 < shape[0] <= self.num_blocks:
            raise ConfigError(f"KV shape {shape} of {dtype} does not match {self.num_blocks} blocks of "
                              f"{self.config.block_bytes} bytes")
        return self.kv_range.view(dtype, tuple(shape))

    def register_residual(self, layer: int, nbytes: int) -> torch.Tensor:
        """Give ``layer`` a residual range of ``nbytes`` padded to whole units, each unit a BACKED unit that stays
        mapped into the KV range too. Returns the uint8 view the kernels read (``nbytes`` long)."""
        num_chunks = -(-nbytes // self.config.unit_bytes)
        try:
            units = self.state.bind_residual(layer, num_chunks)
        except PoolExhausted as exc:
            raise ConfigError(f"residual of layer {layer} does not fit the shared region: {exc}") from exc
        rng = VirtualRange(self.backend, num_chunks * self.config.unit_bytes, unit_bytes=self.config.unit_bytes)
        for index, unit in enumerate(units):
            rng.map_unit(index, self._handles[unit], set_access=False)
        rng.set_access(0, num_chunks)
        whole = rng.view(torch.uint8)  # made while every unit is mapped; the restore worker slices it
        self._residuals[layer] = (rng, nbytes, whole)
        return whole[:nbytes]

    def residual_view(self, layer: int) -> torch.Tensor:
        _, nbytes, whole = self._residuals[layer]
        return whole[:nbytes]

    def residual_range(self, layer: int) -> VirtualRange:
        return self._residuals[layer][0]

    # ----------------------------------------------------------------- Algorithm 1
    def alloc_blocks(self, n: int, *, allow_backed: bool = True,
                     allow_backed_layers: Collection[int] | None = None) -> AllocResult:
        return self.state.alloc_blocks(n, allow_backed=allow_backed, allow_backed_layers=allow_backed_layers)

    def free_blocks(self, blocks: Iterable[int]) -> list[int]:
        return self.state.free_blocks(blocks)

    def can_alloc(self, n: int, allow_backed: bool = True, allow_backed_layers: Collection[int] | None = None) -> bool:
        return self.state.can_alloc(n, allow_backed, allow_backed_layers)

    def evict_layers(self, layers: Iterable[int]) -> list[int]:
        return self.state.evict_layers(layers)

    def mode_for_next_step(self) -> frozenset[int]:
        """The layers that must run FP8-only in the step about to start (empty: full mode)."""
        return self.state.fast_layers

    # ----------------------------------------------------------------- backup and restore
    def attach_backup(self, backup: ResidualBackup) -> None:
        missing = set(self._residuals) - set(backup.layers())
        short = [layer for layer in self._residuals if layer in backup.layers()
                 and backup.host(layer).numel() != self._residuals[layer][1]]
        if missing or short:
            raise ConfigError(f"residual backup lacks layers {sorted(missing)} or has wrong sizes for {short}")
        self.backup = backup

    def load_residuals(self) -> object | None:
        """Startup: one asynchronous copy per residual from the backup; returns the event the compute stream waits
        on (``None`` on the CPU)."""
        backup = self._need_backup()
        return one_shot_copy(((self.residual_view(layer), backup.host(layer)) for layer in self._residuals),
                             self.device)

    def _need_backup(self) -> ResidualBackup:
        if self.backup is None:
            raise ConfigError("no residual backup attached: call attach_backup first")
        return self.backup

    def restores_landed(self) -> bool:
        """True when no restore copy is still in flight (nothing was ever submitted counts as landed)."""
        return self._worker is None or self._worker.all_finished()

    def _worker_started(self) -> RestoreWorker:
        if self._worker is None:
            self._worker = RestoreWorker(self.device, chunk_bytes=self.config.restore_chunk_bytes,
                                         max_inflight_bytes=self.config.max_inflight_bytes)
        return self._worker

    def between_steps(self, *, restore: bool = True, restore_layers: Collection[int] | None = None) -> StepReport:
        """Commit restores whose copies finished, abort failed ones, then plan and submit new ones."""
        batches = self._worker.poll() if self._worker is not None else []
        committed, failed = self._commit(batches)
        submitted = 0
        if restore and self.backup is not None:
            submitted = self._submit_restores(restore_layers)
        return StepReport(tuple(committed), tuple(failed), submitted, tuple(batches))

    def _commit(self, batches: list[RestoreBatch]) -> tuple[list[RestoreTask], list[RestoreFailed]]:
        committed: list[RestoreTask] = []
        failed: list[RestoreFailed] = []
        for batch in batches:
            for task in batch.tasks:
                if batch.error is None:
                    self.state.commit_restore(task)
                    committed.append(task)
                else:
                    self.state.abort_restore(task)
            if batch.error is not None:
                failed.append(batch.error)
                self.restore_failures.append(batch.error)
        return committed, failed

    def _submit_restores(self, layers: Collection[int] | None) -> int:
        """Plan and submit batch by batch, so the first copies start while later ones are still being planned."""
        worker: RestoreWorker | None = None
        ready: Any = None
        pending: list[RestoreTask] = []
        count = 0
        while True:
            task = self.state.plan_restore(layers)
            full = len(pending) == self.config.restore_batch_units
            if pending and (task is None or full or task.chunk.layer != pending[0].chunk.layer):
                if worker is None:
                    worker = self._worker_started()
                    ready = torch.cuda.current_stream(self.device).record_event() if self.device.type == "cuda" \
                        else None
                worker.submit(self._batch(sorted(pending, key=lambda t: t.chunk.index), ready))
                pending, count = [], count + 1
            if task is None:
                return count
            pending.append(task)

    def _batch(self, tasks: list[RestoreTask], ready: Any) -> RestoreBatch:
        layer = tasks[0].chunk.layer
        rng, nbytes, whole = self._residuals[layer]
        host = self._need_backup().host(layer)
        unit = self.config.unit_bytes
        remaps = [Remap(rng, t.chunk.index, self._handles[t.unit]) for t in tasks]
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        run_first = tasks[0].chunk.index
        for i, task in enumerate(tasks):  # one copy per run of consecutive chunks (chunking spans unit edges)
            last = i + 1 == len(tasks) or tasks[i + 1].chunk.index != task.chunk.index + 1
            if last:
                start, end = run_first * unit, min((task.chunk.index + 1) * unit, nbytes)
                copies.append((whole[start:end], host[start:end]))
                if i + 1 < len(tasks):
                    run_first = tasks[i + 1].chunk.index
        return RestoreBatch(tuple(tasks), remaps, copies, ready)

    def wait_restores(self, timeout: float | None = None) -> StepReport:
        """Block until submitted restores finish and commit them (tests, benchmarks, shutdown)."""
        if self._worker is not None:
            self._worker.drain(timeout)
        return self.between_steps(restore=False)

    # ----------------------------------------------------------------- teardown
    def _release_handles(self) -> None:
        for handle in self._handles:
            self.backend.release(handle)
        self._handles = []

    def close(self) -> None:
        if self._worker is not None:
            self._worker.drain()  # copies still in flight must land before their ranges are unmapped
            self._worker.close()
            self._worker = None
        for rng, _, _ in self._residuals.values():
            rng.close()
        self._residuals.clear()
        self.kv_range.close()
        self._release_handles()
