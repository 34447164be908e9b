"""Admission a demoting KV pool can keep (``KVFidelityConfig.admission = "base-floor"``).

A request is admitted, and its prompt counted in the demand D_t that demotion answers, only while every admitted
request could still reach its final length (prompt + max tokens) with all its unprotected pairs in BASE: the sum of
those floors must fit the blocks KV can have. Counting admissions without this bound let the H200 engine demote to
admit at concurrency 64 on the 20 GB dense pool until 87 % of reads were BASE, and then preempt 2,007 times, since
even an all-BASE pool cannot hold 64 requests of 5,120 tokens (21 GB at half size). The bound is SGLang's
conservative admission (reserve each running request's remaining max tokens) with BASE pairs counted at half size.
Plain Python: the engine's scheduler and the simulator both call it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S")  # a scheduler's sequence type


def base_floor_blocks(final_tokens: int, block_size: int, protected_pairs: int) -> tuple[int, int]:
    """(blocks at full fidelity, blocks saved with every unprotected full pair in BASE) for one sequence."""
    blocks = -(-final_tokens // block_size)
    return blocks, max(0, blocks // 2 - protected_pairs)


def _fits(need: int, saved: int, capacity_blocks: int, host_slots: int | None, headroom_blocks: int) -> bool:
    if host_slots is not None:  # each saved block needs a host slot for its low bytes
        saved = min(saved, host_slots)
    return need - saved <= capacity_blocks - headroom_blocks


def fits_at_base(final_tokens: Iterable[int], capacity_blocks: int, block_size: int, protected_pairs: int,
                 host_slots: int | None = None, headroom_blocks: int = 0) -> bool:
    """Whether sequences of these final lengths fit ``capacity_blocks`` less ``headroom_blocks`` with demotion's
    help; ``host_slots`` caps the saving."""
    need = saved = 0
    for tokens in final_tokens:
        blocks, saving = base_floor_blocks(tokens, block_size, protected_pairs)
        need += blocks
        saved += saving
    return _fits(need, saved, capacity_blocks, host_slots, headroom_blocks)


@dataclass(slots=True)
class FloorTally:
    """What the admitted sequences add up to: how many, their blocks at full fidelity, the blocks BASE would save."""

    count: int = 0
    need: int = 0
    saved: int = 0


class BaseFloorBound(Generic[S]):
    """The bound for a scheduler: ``tally(running)`` once per pass, then ``admit(tally, candidate)`` for each queued
    request in order, which is True (and counts the candidate in) when nothing is admitted yet (an oversized request
    still runs alone) or when the admitted sequences and the candidate fit at their BASE floors.

    Demotion lags the step that needs it by up to a batch; ``headroom_blocks`` = 2 x B_min (32) removed the last
    preemptions in simulation (1024 / 256 tokens at concurrency 64 on 2,384 blocks: 2 preemptions at 0 and 16, none
    at 32, and no change in the full-size runs, whose P90 TTFT rose from 5 s to 18 s at 128). It never exceeds a
    sixteenth of the pool: the demo's 48-block pool would otherwise keep 32 blocks back and admit one request at a
    time."""

    def __init__(self, capacity_blocks: Callable[[], int], final_length: Callable[[S], int], block_size: int,
                 protected_pairs: int, host_slots: int | None = None, headroom_blocks: int = 0) -> None:
        self.capacity_blocks = capacity_blocks
        self.final_length = final_length
        self.block_size = block_size
        self.protected_pairs = protected_pairs
        self.host_slots = host_slots
        self.headroom_blocks = headroom_blocks

    def tally(self, admitted: Iterable[S]) -> FloorTally:
        tally = FloorTally()
        for seq in admitted:
            self._count(tally, *self._floor(seq))
        return tally

    def admit(self, tally: FloorTally, candidate: S) -> bool:
        blocks, saving = self._floor(candidate)
        if tally.count:
            capacity = self.capacity_blocks()
            headroom = min(self.headroom_blocks, capacity // 16)
            if not _fits(tally.need + blocks, tally.saved + saving, capacity, self.host_slots, headroom):
                return False
        self._count(tally, blocks, saving)
        return True

    def _floor(self, seq: S) -> tuple[int, int]:
        return base_floor_blocks(self.final_length(seq), self.block_size, self.protected_pairs)

    @staticmethod
    def _count(tally: FloorTally, blocks: int, saving: int) -> None:
        tally.count += 1
        tally.need += blocks
        tally.saved += saving
