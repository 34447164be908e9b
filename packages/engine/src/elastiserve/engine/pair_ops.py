"""The records of pair transitions between the KV manager (bookkeeping) and the runner (device work); plain Python.

A ``DemoteOp`` packs a TARGET pair into its first block and sends both blocks' low bytes to a host slot; a
``PromoteOp`` unpacks a BASE pair into two fresh blocks from that slot. ``BaseRun`` bounds a sequence's BASE pairs, so
the attention dispatch can tell a TARGET-BASE-TARGET run (structured path) from scattered pairs (general path).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastiserve.engine.sequence import PairState


@dataclass(frozen=True, slots=True)
class DemoteOp:
    request_id: str
    pair: int
    block_a: int  # keeps the packed pair
    block_b: int  # returns to the pool once the pack kernel is issued
    slot: int  # host-backing slot receiving the low bytes of A and B


@dataclass(frozen=True, slots=True)
class PromoteOp:
    request_id: str
    pair: int
    packed_block: int
    dst_a: int
    dst_b: int
    slot: int


@dataclass(slots=True)
class BaseRun:
    """A sequence's pairs that readers treat as BASE (BASE or PROMOTING): ``count`` of them, all inside
    ``[first, end)`` with ``first`` and ``end - 1`` among them, so they are one run exactly when ``count`` fills it."""

    first: int
    end: int
    count: int = 0

    @property
    def contiguous(self) -> bool:
        return self.count == self.end - self.first

    def add(self, pair: int) -> None:
        self.first, self.end, self.count = min(self.first, pair), max(self.end, pair + 1), self.count + 1

    def drop(self, pair: int, states: list[PairState]) -> None:
        """``pair`` is TARGET again. Only an edge pair of a scattered set costs a walk (over the pairs between)."""
        contiguous = self.contiguous
        self.count -= 1
        if contiguous:  # a middle pair leaves the bounds as they are; the run is then scattered
            if pair == self.first:
                self.first += 1
            elif pair == self.end - 1:
                self.end -= 1
        elif pair in (self.first, self.end - 1):
            base = [p for p in range(self.first, self.end) if states[p] is not PairState.TARGET]
            self.first, self.end = base[0], base[-1] + 1
