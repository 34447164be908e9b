"""Algorithm 1 of DPS (KV block allocation and free in Semi-Unified Memory) as plain Python: no torch.

Unit sets: FREE (no KV blocks, no residual), BACKED (holds a valid residual chunk), AVAIL / FULL (KV units with /
without a free block), and RESTORING (reserved by a planned restore; not in the paper, which restores synchronously).
A residual chunk ``(layer, index)`` is one unit of a decoder layer's residual range; it is valid (its unit BACKED),
STALE (its unit was taken for KV or evicted; awaiting restoration) or being restored. EVICTED is the set of layers
whose residual is not fully on the device: exactly ``fast_layers``, the layers that run FP8-only.

Fast mode for a layer begins exactly when one of its BACKED units is taken; it ends only when every chunk of the
layer has been restored and committed. The physical work lives in ``sum_manager``; this class only keeps the books.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from elastiserve.memory.errors import BlockStateError, ConfigError, PoolExhausted


class UnitSet(StrEnum):
    FREE = "free"
    BACKED = "backed"
    AVAIL = "avail"
    FULL = "full"
    RESTORING = "restoring"


class ResidualChunk(NamedTuple):
    """One unit-sized piece of a layer's residual. A tuple, so that its hash is C's: the bookkeeping hashes chunks
    in every dict it keeps, and a frozen dataclass's generated ``__hash__`` was a third of an eviction's time."""

    layer: int
    index: int


@dataclass(frozen=True, slots=True)
class AllocResult:
    blocks: tuple[int, ...]
    taken_residuals: tuple[ResidualChunk, ...]  # chunks made stale by this allocation (their units now hold KV)


@dataclass(frozen=True, slots=True)
class RestoreTask:
    chunk: ResidualChunk
    unit: int  # the FREE unit reserved to back the chunk again
    previous_unit: int  # the unit the chunk's residual range maps now (equal to ``unit`` means no remap)


@dataclass(frozen=True, slots=True)
class ModeEvent:
    kind: str  # "fast": layers entered FP8-only; "full": layers are whole again
    layers: frozenset[int]
    fast_layers: frozenset[int]  # after the change
    reason: str


class SumState:
    """Unit and residual bookkeeping of the shared region.

    ``unit_blocks[u]`` lists the KV block ids wholly inside unit ``u`` (block ids straddling two units are dead and
    appear nowhere). Every unit starts FREE; ``bind_residual`` turns FREE units into BACKED ones.
    """

    def __init__(self, unit_blocks: Sequence[Sequence[int]]) -> None:
        self._unit_blocks = tuple(tuple(blocks) for blocks in unit_blocks)
        self._unit_of_block: dict[int, int] = {}
        for unit, blocks in enumerate(self._unit_blocks):
            if not blocks:
                raise ConfigError(f"unit {unit} holds no whole KV block: choose a larger unit_bytes")
            for block in blocks:
                if block in self._unit_of_block:
                    raise ConfigError(f"block {block} is listed in units {self._unit_of_block[block]} and {unit}")
                self._unit_of_block[block] = unit
        self._free_in_unit = [list(reversed(blocks)) for blocks in self._unit_blocks]  # pop() gives the lowest id
        self._allocated: set[int] = set()
        self._sets: dict[UnitSet, dict[int, None]] = {kind: {} for kind in UnitSet}
        self._where = [UnitSet.FREE] * len(self._unit_blocks)
        self._sets[UnitSet.FREE] = dict.fromkeys(range(len(self._unit_blocks)))
        self._kv_free_blocks = sum(len(blocks) for blocks in self._unit_blocks)  # free blocks in FREE + AVAIL units
        self._chunks_per_layer: dict[int, int] = {}
        self._chunk_unit: dict[ResidualChunk, int] = {}
        self._backed_chunk: dict[int, ResidualChunk] = {}  # BACKED unit -> its valid chunk
        self._backed_by_layer: dict[int, dict[int, None]] = {}
        self._stale_by_layer: dict[int, dict[ResidualChunk, None]] = {}  # stale, no restore planned
        self._restoring: dict[ResidualChunk, RestoreTask] = {}
        self._stale_at_unit: dict[int, dict[ResidualChunk, None]] = {}  # stale chunk -> the unit its range maps
        self._in_place: dict[ResidualChunk, None] = {}  # stale chunks whose mapped unit is FREE: no remap needed
        self._restoring_per_layer: dict[int, int] = {}
        self._fast_layers: frozenset[int] = frozenset()
        self.mode_events: list[ModeEvent] = []

    # ----------------------------------------------------------------- queries
    @property
    def num_units(self) -> int:
        return len(self._unit_blocks)

    @property
    def fast_layers(self) -> frozenset[int]:
        return self._fast_layers

    evicted_layers = fast_layers

    @property
    def is_full_mode(self) -> bool:
        return not self._fast_layers

    def unit_blocks(self, unit: int) -> tuple[int, ...]:
        return self._unit_blocks[unit]

    def unit_of_block(self, block: int) -> int:
        return self._unit_of_block[block]

    def set_of(self, unit: int) -> UnitSet:
        return self._where[unit]

    def units_in(self, kind: UnitSet) -> tuple[int, ...]:
        return tuple(self._sets[kind])

    def residual_layers(self) -> dict[int, int]:
        return dict(self._chunks_per_layer)

    def chunk_unit(self, chunk: ResidualChunk) -> int:
        return self._chunk_unit[chunk]

    def backed_chunk(self, unit: int) -> ResidualChunk | None:
        return self._backed_chunk.get(unit)

    def stale_chunks(self) -> tuple[ResidualChunk, ...]:
        return tuple(chunk for chunks in self._stale_by_layer.values() for chunk in chunks)

    def restoring_tasks(self) -> tuple[RestoreTask, ...]:
        return tuple(self._restoring.values())

    def num_free_blocks(self, include_backed: bool = False, layers: Collection[int] | None = None) -> int:
        """Blocks an allocation could get now; ``include_backed`` counts BACKED units (of ``layers`` if given)."""
        if not include_backed:
            return self._kv_free_blocks
        backed = sum(len(self._unit_blocks[u]) for layer, units in self._backed_by_layer.items()
                     if layers is None or layer in layers for u in units)
        return self._kv_free_blocks + backed

    def num_allocated_blocks(self) -> int:
        return len(self._allocated)

    def num_backed_units(self) -> int:
        return len(self._sets[UnitSet.BACKED])

    def num_free_units(self) -> int:
        return len(self._sets[UnitSet.FREE])

    def num_stale_chunks(self) -> int:
        return sum(len(chunks) for chunks in self._stale_by_layer.values()) + len(self._restoring)

    def can_alloc(self, n: int, allow_backed: bool = True, allow_backed_layers: Collection[int] | None = None) -> bool:
        return n <= self.num_free_blocks(include_backed=allow_backed, layers=allow_backed_layers)

    def restore_wanted(self) -> bool:
        """Line 37 of Algorithm 1: a restore could start now (a stale chunk waits and a unit is FREE)."""
        return bool(self._sets[UnitSet.FREE]) and any(self._stale_by_layer.values())

    # ----------------------------------------------------------------- transitions
    def _move(self, unit: int, to: UnitSet) -> None:
        was_free = self._where[unit] is UnitSet.FREE
        del self._sets[self._where[unit]][unit]
        self._sets[to][unit] = None
        self._where[unit] = to
        if was_free != (to is UnitSet.FREE):
            for chunk in self._stale_at_unit.get(unit, ()):
                if to is UnitSet.FREE:
                    self._in_place[chunk] = None
                else:
                    self._in_place.pop(chunk, None)

    def _mark_stale(self, chunk: ResidualChunk) -> None:
        self._stale_by_layer.setdefault(chunk.layer, {})[chunk] = None
        unit = self._chunk_unit[chunk]
        self._stale_at_unit.setdefault(unit, {})[chunk] = None
        if self._where[unit] is UnitSet.FREE:
            self._in_place[chunk] = None

    def _unmark_stale(self, chunk: ResidualChunk) -> None:
        del self._stale_by_layer[chunk.layer][chunk]
        del self._stale_at_unit[self._chunk_unit[chunk]][chunk]
        self._in_place.pop(chunk, None)

    def _set_fast_layers(self, reason: str) -> None:
        now = frozenset(layer for layer in self._chunks_per_layer if self._outstanding(layer))
        entered, left = now - self._fast_layers, self._fast_layers - now
        self._fast_layers = now
        if entered:
            self.mode_events.append(ModeEvent("fast", frozenset(entered), now, reason))
        if left:
            self.mode_events.append(ModeEvent("full", frozenset(left), now, reason))

    def bind_residual(self, layer: int, num_chunks: int) -> list[int]:
        """Back ``num_chunks`` residual chunks of ``layer`` with FREE units (startup); returns the units in order."""
        if layer in self._chunks_per_layer:
            raise ConfigError(f"layer {layer} already has a residual")
        if num_chunks <= 0:
            raise ConfigError(f"a residual needs at least one unit, got {num_chunks}")
        if num_chunks > len(self._sets[UnitSet.FREE]):
            raise PoolExhausted(f"layer {layer} needs {num_chunks} FREE units, {self.num_free_units()} are left")
        units = list(self._sets[UnitSet.FREE])[-num_chunks:]  # take from the top; KV grows from the bottom
        self._chunks_per_layer[layer] = num_chunks
        self._backed_by_layer[layer] = {}
        for index, unit in enumerate(units):
            self._back(ResidualChunk(layer, index), unit)
            self._kv_free_blocks -= len(self._unit_blocks[unit])
        return units

    def _back(self, chunk: ResidualChunk, unit: int) -> None:
        self._move(unit, UnitSet.BACKED)
        self._chunk_unit[chunk] = unit
        self._backed_chunk[unit] = chunk
        self._backed_by_layer[chunk.layer][unit] = None

    def _take_backed(self, unit: int) -> ResidualChunk:
        chunk = self._backed_chunk.pop(unit)
        del self._backed_by_layer[chunk.layer][unit]
        self._mark_stale(chunk)
        return chunk

    def _pick_backed(self, allowed: Collection[int] | None) -> int:
        """Prefer layers already in fast mode (no new precision loss), then the highest layer index."""
        layers = [layer for layer, units in self._backed_by_layer.items()
                  if units and (allowed is None or layer in allowed)]
        layer = max(layers, key=lambda layer: (layer in self._fast_layers, layer))
        return next(iter(self._backed_by_layer[layer]))

    def alloc_blocks(self, n: int, *, allow_backed: bool = True,
                     allow_backed_layers: Collection[int] | None = None) -> AllocResult:
        """Allocate ``n`` KV blocks (Algorithm 1, ALLOCKVBLOCK); raise ``PoolExhausted`` with no side effect."""
        if n < 0:
            raise BlockStateError(f"cannot allocate {n} blocks")
        if not self.can_alloc(n, allow_backed, allow_backed_layers):
            raise PoolExhausted(f"{n} blocks requested, {self.num_free_blocks(allow_backed, allow_backed_layers)} "
                                f"available (allow_backed={allow_backed})")
        result: list[int] = []
        taken: list[ResidualChunk] = []
        avail = self._sets[UnitSet.AVAIL]
        while len(result) < n:
            if not avail:
                if self._sets[UnitSet.FREE]:
                    unit = next(iter(self._sets[UnitSet.FREE]))
                else:
                    unit = self._pick_backed(allow_backed_layers)
                    taken.append(self._take_backed(unit))
                    self._kv_free_blocks += len(self._unit_blocks[unit])
                self._move(unit, UnitSet.AVAIL)
            unit = next(iter(avail))
            free = self._free_in_unit[unit]
            count = min(n - len(result), len(free))
            got = [free.pop() for _ in range(count)]
            result.extend(got)
            self._allocated.update(got)
            self._kv_free_blocks -= count
            if not free:
                self._move(unit, UnitSet.FULL)
        if taken:
            self._set_fast_layers("kv allocation took backed units")
        return AllocResult(tuple(result), tuple(taken))

    def free_blocks(self, blocks: Iterable[int]) -> list[int]:
        """Return blocks to their units (FREEKVBLOCK); returns the units that became FREE."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks) or not self._allocated.issuperset(blocks):
            bad = sorted(set(b for b in blocks if b not in self._allocated or blocks.count(b) > 1))
            raise BlockStateError(f"freeing blocks that are not allocated (or listed twice): {bad[:8]}")
        emptied: list[int] = []
        for block in blocks:
            unit = self._unit_of_block[block]
            self._allocated.remove(block)
            self._free_in_unit[unit].append(block)
            self._kv_free_blocks += 1
            if self._where[unit] is UnitSet.FULL:
                self._move(unit, UnitSet.AVAIL)
            if len(self._free_in_unit[unit]) == len(self._unit_blocks[unit]):
                self._free_in_unit[unit].sort(reverse=True)
                self._move(unit, UnitSet.FREE)
                emptied.append(unit)
        return emptied

    def evict_layers(self, layers: Iterable[int]) -> list[int]:
        """Make the residuals of ``layers`` stale and hand their BACKED units to KV as FREE units."""
        # The same steps as _take_backed + _move per unit, in bulk: evicting Qwen3-30B-A3B's 48 layers (19,008 units)
        # took 18 ms between two steps on the H200's host (session 15), 59 ms on the CI's CPU; this takes 15.7 ms
        # there (the H200's gap at that step fell to 7.6 ms).
        layers = list(layers)
        if missing := [layer for layer in layers if layer not in self._chunks_per_layer]:
            raise BlockStateError(f"layers {missing} have no residual")
        freed: list[int] = []
        free_units, backed_units, where = self._sets[UnitSet.FREE], self._sets[UnitSet.BACKED], self._where
        stale_at_unit, in_place = self._stale_at_unit, self._in_place
        for layer in layers:
            units = list(self._backed_by_layer[layer])
            if not units:
                continue
            self._backed_by_layer[layer].clear()
            chunks = [self._backed_chunk.pop(unit) for unit in units]  # a BACKED unit holds the chunk mapped there
            self._stale_by_layer.setdefault(layer, {}).update(dict.fromkeys(chunks))
            for unit, chunk in zip(units, chunks, strict=True):
                at_unit = stale_at_unit.get(unit)
                if at_unit is None:
                    stale_at_unit[unit] = {chunk: None}
                    in_place[chunk] = None  # FREE now: a stale chunk mapped here restores without a remap
                else:
                    at_unit[chunk] = None
                    in_place.update(at_unit)
                del backed_units[unit]
                where[unit] = UnitSet.FREE
            free_units.update(dict.fromkeys(units))
            self._kv_free_blocks += sum(map(len, map(self._unit_blocks.__getitem__, units)))
            freed += units
        if freed:
            self._set_fast_layers("layers evicted")
        return freed

    # ----------------------------------------------------------------- restore
    def plan_restore(self, layers: Collection[int] | None = None) -> RestoreTask | None:
        """Reserve a FREE unit for one stale chunk (of ``layers`` if given), or ``None`` when nothing can start.

        Chunks whose own unit is FREE again go first: restoring them needs a copy but no remap (VMM calls cost about
        as much as the copy itself at 2 MiB units). Otherwise the layer closest to whole goes first, so layers
        return to full precision one by one.
        """
        free = self._sets[UnitSet.FREE]
        chunk = next((c for c in self._in_place if layers is None or c.layer in layers), None)
        if chunk is None:
            waiting = [layer for layer, chunks in self._stale_by_layer.items()
                       if chunks and (layers is None or layer in layers)]
            if not free or not waiting:
                return None
            layer = min(waiting, key=lambda layer: (self._outstanding(layer), layer))
            chunk = next(iter(self._stale_by_layer[layer]))
        layer = chunk.layer
        previous = self._chunk_unit[chunk]
        unit = previous if previous in free else next(iter(free))
        self._unmark_stale(chunk)
        self._move(unit, UnitSet.RESTORING)
        self._kv_free_blocks -= len(self._unit_blocks[unit])
        task = RestoreTask(chunk, unit, previous)
        self._restoring[chunk] = task
        self._restoring_per_layer[layer] = self._restoring_per_layer.get(layer, 0) + 1
        return task

    def _outstanding(self, layer: int) -> int:
        return len(self._stale_by_layer.get(layer, ())) + self._restoring_per_layer.get(layer, 0)

    def _finish(self, task: RestoreTask) -> None:
        if self._restoring.get(task.chunk) != task:
            raise BlockStateError(f"{task} is not a planned restore")
        del self._restoring[task.chunk]
        self._restoring_per_layer[task.chunk.layer] -= 1

    def commit_restore(self, task: RestoreTask) -> None:
        """The copy completed: the unit is BACKED by the chunk again (call between steps only)."""
        self._finish(task)
        self._back(task.chunk, task.unit)
        self._set_fast_layers("residual restored")

    def abort_restore(self, task: RestoreTask) -> None:
        """The restore failed: the unit returns to FREE and the chunk stays stale (its layer stays FP8)."""
        self._finish(task)
        self._move(task.unit, UnitSet.FREE)
        self._kv_free_blocks += len(self._unit_blocks[task.unit])
        self._mark_stale(task.chunk)

    # ----------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (tests and debug runs call this)."""
        units = range(self.num_units)
        members = [u for kind in UnitSet for u in self._sets[kind]]
        _require(sorted(members) == list(units), "every unit is in exactly one set")
        _require(all(u in self._sets[self._where[u]] for u in units), "unit set index matches the sets")
        free_lists = [b for u in units for b in self._free_in_unit[u]]
        _require(len(free_lists) == len(set(free_lists)), "no block is free twice")
        _require(not self._allocated.intersection(free_lists), "no block is both free and allocated")
        _require(len(free_lists) + len(self._allocated) == len(self._unit_of_block), "every block is accounted for")
        for u in units:
            free, total, kind = len(self._free_in_unit[u]), len(self._unit_blocks[u]), self._where[u]
            whole = kind in (UnitSet.FREE, UnitSet.BACKED, UnitSet.RESTORING)
            _require(not whole or free == total, f"unit {u} in {kind.value} holds no KV block")
            _require(kind is not UnitSet.AVAIL or 0 < free < total, f"AVAIL unit {u} is partly used")
            _require(kind is not UnitSet.FULL or free == 0, f"FULL unit {u} has no free block")
        _require(set(self._backed_chunk) == set(self._sets[UnitSet.BACKED]), "BACKED units are the valid chunks")
        _require({t.unit for t in self._restoring.values()} == set(self._sets[UnitSet.RESTORING]),
                 "RESTORING units are the planned restores")
        stale = self.stale_chunks()
        valid = set(self._backed_chunk.values())
        everything = [*valid, *stale, *self._restoring]
        expected = {ResidualChunk(layer, i) for layer, n in self._chunks_per_layer.items() for i in range(n)}
        _require(len(everything) == len(expected) and set(everything) == expected,
                 "each chunk is exactly one of valid / stale / restoring")
        fast = {c.layer for c in stale} | {c.layer for c in self._restoring}
        _require(self._fast_layers == fast, "fast layers are the layers with a stale or restoring chunk")
        in_place = {c for c in stale if self._where[self._chunk_unit[c]] is UnitSet.FREE}
        _require(set(self._in_place) == in_place, "in-place candidates are the stale chunks whose unit is FREE")
        counted = sum(len(self._free_in_unit[u]) for kind in (UnitSet.FREE, UnitSet.AVAIL) for u in self._sets[kind])
        _require(self._kv_free_blocks == counted, "the free-block counter matches the free lists")


def _require(condition: bool, invariant: str) -> None:
    if not condition:
        raise AssertionError(f"SumState invariant broken: {invariant}")
