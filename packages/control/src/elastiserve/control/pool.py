"""KV pool model for the simulator: the ``KVPoolModel`` protocol and a minimal in-simulator implementation.

``UnitPool`` follows DPS Algorithm 1 over units: native KV units plus, per decoder layer, ``units_per_layer``
residual units that are BACKED (hold weights) until their layer is evicted. Allocation fills AVAIL units first,
then FREE native units, then FREE units of evicted layers (the earliest evicted layer first, so later layers drain
and become restorable), then, when allowed, a BACKED unit, which evicts its layer on the spot (the reactive DPS path).
A layer can be restored only when none of its units holds KV. ``elastiserve.memory.sum_state`` will provide the
real bookkeeping; an adapter with this protocol lets the simulator drive it instead.
"""

from __future__ import annotations

from typing import Protocol

from elastiserve.platforms import ConfigError, ElastiserveError


class PoolError(ElastiserveError, RuntimeError):
    """A block operation that would break the pool's invariants (double free, foreign block, bad restore)."""


class KVPoolModel(Protocol):
    blocks_per_unit: int
    num_layers: int
    units_per_layer: int

    def free_block_count(self) -> int: ...
    def total_blocks(self) -> int: ...
    def native_blocks(self) -> int: ...
    def alloc_blocks(self, n: int, allow_backed: bool = False) -> list[int] | None: ...
    def free_blocks(self, blocks: list[int]) -> None: ...
    def evict_layers(self, layers: list[int]) -> int: ...
    def evicted_layers(self) -> frozenset[int]: ...
    def backed_units(self) -> int: ...
    def free_units(self) -> int: ...
    def plan_restore(self) -> tuple[int, ...]: ...
    def begin_restore(self, layer: int) -> None: ...
    def commit_restore(self, layer: int) -> None: ...


RESIDENT, EVICTED, RESTORING = "resident", "evicted", "restoring"


class UnitPool:
    def __init__(self, native_units: int, num_layers: int, units_per_layer: int, blocks_per_unit: int = 1) -> None:
        if native_units < 1 or num_layers < 0 or units_per_layer < 0 or blocks_per_unit < 1:
            raise ConfigError("UnitPool needs native_units >= 1, blocks_per_unit >= 1 and non-negative residuals")
        self.native_units = native_units
        self.num_layers = num_layers
        self.units_per_layer = units_per_layer
        self.blocks_per_unit = blocks_per_unit
        total_units = native_units + num_layers * units_per_layer
        self._used = [0] * total_units
        self._unit_free: list[list[int]] = [[] for _ in range(total_units)]
        self._avail_native: dict[int, None] = {}
        self._avail_residual: dict[int, None] = {}
        self._free_native = list(range(native_units - 1, -1, -1))
        self._layer_free: list[list[int]] = [[] for _ in range(num_layers)]
        self._layer_state = [RESIDENT] * num_layers
        self._layer_kv_units = [0] * num_layers
        self._evict_order: list[int] = []
        self._allocated: set[int] = set()
        self._free_count = native_units * blocks_per_unit
        self._kv_units = native_units
        self._evicted_cache: frozenset[int] | None = frozenset()

    # ---- queries -------------------------------------------------------------------------------------------
    def layer_of(self, unit: int) -> int | None:
        return None if unit < self.native_units else (unit - self.native_units) // self.units_per_layer

    def layer_units(self, layer: int) -> range:
        start = self.native_units + layer * self.units_per_layer
        return range(start, start + self.units_per_layer)

    def free_block_count(self) -> int:
        return self._free_count

    def total_blocks(self) -> int:
        return self._kv_units * self.blocks_per_unit

    def native_blocks(self) -> int:
        return self.native_units * self.blocks_per_unit

    def allocated_count(self) -> int:
        return len(self._allocated)

    def evicted_layers(self) -> frozenset[int]:
        """Layers whose residual is not usable (evicted or being restored): the fast layers."""
        if self._evicted_cache is None:
            self._evicted_cache = frozenset(i for i, s in enumerate(self._layer_state) if s != RESIDENT)
        return self._evicted_cache

    def backed_units(self) -> int:
        return (self.num_layers - len(self.evicted_layers())) * self.units_per_layer

    def free_units(self) -> int:
        return len(self._free_native) + sum(len(self._layer_free[x]) for x in self._evict_order)

    def plan_restore(self) -> tuple[int, ...]:
        """Evicted layers none of whose units holds KV, in reverse eviction order (last evicted, first back)."""
        return tuple(layer for layer in reversed(self._evict_order)
                     if self._layer_state[layer] == EVICTED and self._layer_kv_units[layer] == 0)

    # ---- allocation (Algorithm 1, ALLOCKVBLOCK / FREEKVBLOCK) ----------------------------------------------
    def _open_unit(self, allow_backed: bool) -> int | None:
        if self._free_native:
            return self._free_native.pop()
        for layer in self._evict_order:
            if self._layer_state[layer] == EVICTED and self._layer_free[layer]:
                return self._layer_free[layer].pop()
        if allow_backed:
            for layer in range(self.num_layers):
                if self._layer_state[layer] == RESIDENT and self.units_per_layer:
                    self.evict_layers([layer])
                    return self._layer_free[layer].pop()
        return None

    def alloc_blocks(self, n: int, allow_backed: bool = False) -> list[int] | None:
        """n blocks, or None (and no change) when they cannot all be found."""
        if n < 0:
            raise PoolError(f"cannot allocate {n} blocks")
        reachable = self._free_count
        if allow_backed:
            reachable += self.backed_units() * self.blocks_per_unit
        if n > reachable:
            return None
        out: list[int] = []
        while len(out) < n:
            avail = self._avail_native or self._avail_residual
            if avail:
                unit = next(iter(avail))
                del avail[unit]
            else:
                unit = self._open_unit(allow_backed)
                assert unit is not None, "reachable count said the blocks exist"
                self._unit_free[unit] = list(range(unit * self.blocks_per_unit + self.blocks_per_unit - 1,
                                                   unit * self.blocks_per_unit - 1, -1))
                layer = self.layer_of(unit)
                if layer is not None:
                    self._layer_kv_units[layer] += 1
            take = min(n - len(out), len(self._unit_free[unit]))
            for _ in range(take):
                out.append(self._unit_free[unit].pop())
            self._used[unit] += take
            if self._unit_free[unit]:
                (self._avail_native if unit < self.native_units else self._avail_residual)[unit] = None
        self._free_count -= n
        self._allocated.update(out)
        return out

    def free_blocks(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._allocated:
                raise PoolError(f"block {block} is not allocated (double free or foreign block)")
            self._allocated.remove(block)
            unit = block // self.blocks_per_unit
            self._unit_free[unit].append(block)
            self._used[unit] -= 1
            self._free_count += 1
            avail = self._avail_native if unit < self.native_units else self._avail_residual
            if self._used[unit] == 0:
                avail.pop(unit, None)
                self._unit_free[unit] = []
                layer = self.layer_of(unit)
                if layer is None:
                    self._free_native.append(unit)
                else:
                    self._layer_kv_units[layer] -= 1
                    self._layer_free[layer].append(unit)
                # The unit's blocks stay counted in _free_count: a FREE unit is whole free capacity.
            else:
                avail[unit] = None

    # ---- residual transitions -----------------------------------------------------------------------------
    def evict_layers(self, layers: list[int]) -> int:
        """Make the residual units of these (resident) layers KV capacity; returns the blocks added."""
        added = 0
        for layer in layers:
            if self._layer_state[layer] != RESIDENT:
                continue
            self._layer_state[layer] = EVICTED
            self._evicted_cache = None
            self._evict_order.append(layer)
            self._layer_free[layer] = list(reversed(self.layer_units(layer)))
            added += self.units_per_layer * self.blocks_per_unit
        self._free_count += added
        self._kv_units += added // self.blocks_per_unit
        return added

    def begin_restore(self, layer: int) -> None:
        """Take an evicted layer's (all FREE) units out of the KV pool so the restore copy can fill them."""
        if self._layer_state[layer] != EVICTED or self._layer_kv_units[layer]:
            raise PoolError(f"layer {layer} is not restorable")
        self._layer_state[layer] = RESTORING
        self._evicted_cache = None
        self._layer_free[layer] = []
        removed = self.units_per_layer * self.blocks_per_unit
        self._free_count -= removed
        self._kv_units -= self.units_per_layer

    def commit_restore(self, layer: int) -> None:
        if self._layer_state[layer] != RESTORING:
            raise PoolError(f"layer {layer} has no restore in flight")
        self._layer_state[layer] = RESIDENT
        self._evicted_cache = None
        self._evict_order.remove(layer)

    def check(self) -> None:
        """Raise PoolError unless every KV block is either allocated once or free once."""
        free_in_units = sum(len(f) for f in self._unit_free)
        whole_free = (len(self._free_native) + sum(len(f) for f in self._layer_free)) * self.blocks_per_unit
        if free_in_units + whole_free != self._free_count:
            raise PoolError("free count drifted")
        if self._free_count + len(self._allocated) != self.total_blocks():
            raise PoolError("a block was lost or counted twice")
        if any(u < 0 for u in self._used) or sum(self._used) != len(self._allocated):
            raise PoolError("unit usage counts drifted")


class SumStatePool:
    """``KVPoolModel`` over the real ``elastiserve.memory.sum_state.SumState`` (the engine's bookkeeping).

    Differences from ``UnitPool`` that the simulator sees: a stale residual chunk can be restored into ANY free unit
    (the memory manager remaps the layer's residual range), so a layer is restorable once there are as many FREE
    units as it has stale chunks; and the reactive BACKED path takes units of layers already fast first.
    """

    def __init__(self, native_units: int, num_layers: int, units_per_layer: int, blocks_per_unit: int = 1) -> None:
        from elastiserve.memory.sum_state import SumState  # plain Python; imported here to keep the dependency soft

        if native_units < 1 or num_layers < 0 or units_per_layer < 0 or blocks_per_unit < 1:
            raise ConfigError("SumStatePool needs native_units >= 1, blocks_per_unit >= 1 and non-negative residuals")
        total_units = native_units + num_layers * units_per_layer
        self.native_units = native_units
        self.num_layers = num_layers
        self.units_per_layer = units_per_layer
        self.blocks_per_unit = blocks_per_unit
        self.state = SumState([range(u * blocks_per_unit, (u + 1) * blocks_per_unit) for u in range(total_units)])
        for layer in range(num_layers):
            if units_per_layer:
                self.state.bind_residual(layer, units_per_layer)
        self._tasks: dict[int, list] = {}

    def free_block_count(self) -> int:
        return self.state.num_free_blocks()

    def total_blocks(self) -> int:
        return self.state.num_free_blocks() + self.state.num_allocated_blocks()

    def native_blocks(self) -> int:
        return self.native_units * self.blocks_per_unit

    def allocated_count(self) -> int:
        return self.state.num_allocated_blocks()

    def alloc_blocks(self, n: int, allow_backed: bool = False) -> list[int] | None:
        from elastiserve.memory.errors import PoolExhausted

        # Counting BACKED capacity walks every unit: only ask for it when the free blocks do not suffice.
        backed = allow_backed and n > self.state.num_free_blocks()
        try:
            return list(self.state.alloc_blocks(n, allow_backed=backed).blocks)
        except PoolExhausted:
            return None

    def free_blocks(self, blocks: list[int]) -> None:
        from elastiserve.memory.errors import BlockStateError

        try:
            self.state.free_blocks(blocks)
        except BlockStateError as exc:
            raise PoolError(str(exc)) from exc

    def evict_layers(self, layers: list[int]) -> int:
        todo = [x for x in layers if x not in self.state.fast_layers]
        return len(self.state.evict_layers(todo)) * self.blocks_per_unit

    def evicted_layers(self) -> frozenset[int]:
        return self.state.fast_layers

    def backed_units(self) -> int:
        return self.state.num_backed_units()

    def free_units(self) -> int:
        return self.state.num_free_units()

    def _stale_per_layer(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for chunk in self.state.stale_chunks():
            counts[chunk.layer] = counts.get(chunk.layer, 0) + 1
        return counts

    def plan_restore(self) -> tuple[int, ...]:
        """Fast layers not being restored whose stale chunks all fit in the FREE units now, fewest chunks first."""
        free = self.state.num_free_units()
        stale = self._stale_per_layer()
        fits = [layer for layer, n in stale.items() if n <= free and layer not in self._tasks]
        return tuple(sorted(fits, key=lambda layer: (stale[layer], -layer)))

    def begin_restore(self, layer: int) -> None:
        need = self._stale_per_layer().get(layer, 0)
        if layer in self._tasks or need == 0 or need > self.state.num_free_units():
            raise PoolError(f"layer {layer} is not restorable")
        self._tasks[layer] = [self.state.plan_restore([layer]) for _ in range(need)]

    def commit_restore(self, layer: int) -> None:
        tasks = self._tasks.pop(layer, None)
        if not tasks:
            raise PoolError(f"layer {layer} has no restore in flight")
        for task in tasks:
            self.state.commit_restore(task)

    def check(self) -> None:
        try:
            self.state.check_invariants()
        except AssertionError as exc:
            raise PoolError(str(exc)) from exc


def make_pool(kind: str, native_units: int, num_layers: int, units_per_layer: int, blocks_per_unit: int = 1):
    """``"sum_state"`` (the real bookkeeping from elastiserve-memory), ``"sim"`` (``UnitPool``), or ``"auto"``:
    the real one when elastiserve-memory is installed."""
    if kind == "auto":
        try:
            import elastiserve.memory.sum_state  # noqa: F401
            kind = "sum_state"
        except ImportError:
            kind = "sim"
    if kind == "sum_state":
        return SumStatePool(native_units, num_layers, units_per_layer, blocks_per_unit)
    if kind == "sim":
        return UnitPool(native_units, num_layers, units_per_layer, blocks_per_unit)
    raise ConfigError(f"unknown pool kind {kind!r}; choose 'auto', 'sum_state' or 'sim'")
