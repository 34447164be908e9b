"""Physical KV block pools behind ``KVManager``: in production the SUM bookkeeping of ``elastiserve.memory``
(Algorithm 1), where taking a BACKED unit makes a residual stale (fast mode next step); in tests a flat free list.
Plain Python, no torch."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from elastiserve.engine.errors import EngineError


class BlockPool(Protocol):
    """Physical KV blocks; ``allocate`` is all-or-nothing and returns None when it cannot serve ``n``."""

    num_blocks: int

    def num_free(self, allow_backed: bool) -> int: ...

    def num_allocated(self) -> int: ...

    def allocate(self, n: int, allow_backed: bool) -> list[int] | None: ...

    def free(self, blocks: Iterable[int]) -> None: ...

    def drain_stale_layers(self) -> frozenset[int]: ...


class FlatBlockPool:
    """A free list of blocks with no shared region (static pools, CPU tests)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    def num_free(self, allow_backed: bool = False) -> int:
        return len(self._free)

    def num_allocated(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int, allow_backed: bool = False) -> list[int] | None:
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise EngineError(f"block {b} freed twice")
            self._is_free[b] = True
            self._free.append(b)

    def drain_stale_layers(self) -> frozenset[int]:
        return frozenset()


class SumBlockPool:
    """``BlockPool`` over ``elastiserve.memory.sum_state.SumState`` (Algorithm 1): taking a BACKED unit makes its
    layer's residual stale; the engine reads those layers through ``drain_stale_layers`` (fast mode next step)."""

    def __init__(self, state) -> None:  # state: SumState (imported lazily by the runner; plain Python)
        self.state = state
        self.num_blocks = sum(len(state.unit_blocks(u)) for u in range(state.num_units))
        self._stale: set[int] = set()

    def num_free(self, allow_backed: bool = False) -> int:
        return self.state.num_free_blocks(include_backed=allow_backed)

    def num_allocated(self) -> int:
        return self.state.num_allocated_blocks()

    def allocate(self, n: int, allow_backed: bool = False) -> list[int] | None:
        if n == 0:
            return []
        if not self.state.can_alloc(n, allow_backed):
            return None
        result = self.state.alloc_blocks(n, allow_backed=allow_backed)
        self._stale.update(chunk.layer for chunk in result.taken_residuals)
        return list(result.blocks)

    def free(self, blocks: Iterable[int]) -> None:
        self.state.free_blocks(list(blocks))

    def drain_stale_layers(self) -> frozenset[int]:
        stale, self._stale = frozenset(self._stale), set()
        return stale
