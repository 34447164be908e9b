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
from typing import TypeVar

S = TypeVar("S")  # a scheduler's sequence type


def base_floor_blocks(final_tokens: int, block_size: int, protected_pairs: int) -> tuple[int, int]:
    """(blocks at full fidelity, blocks saved with every unprotected full pair in BASE) for one sequence."""
    blocks = -(-final_tokens // block_size)
    return blocks, max(0, blocks // 2 - protected_pairs)


def fits_at_base(final_tokens: Iterable[int], capacity_blocks: int, block_size: int, protected_pairs: int,
                 host_slots: int | None = None, headroom_blocks: int = 0) -> bool:
    """Whether sequences of these final lengths fit ``capacity_blocks`` less ``headroom_blocks`` with demotion's
    help; each saved block needs a host slot for its low bytes, so ``host_slots`` caps the saving."""
    need = saved = 0
    for tokens in final_tokens:
        blocks, saving = base_floor_blocks(tokens, block_size, protected_pairs)
        need += blocks
        saved += saving
    if host_slots is not None:
        saved = min(saved, host_slots)
    return need - saved <= capacity_blocks - headroom_blocks


def base_floor_rule(capacity_blocks: Callable[[], int], final_length: Callable[[S], int], block_size: int,
                    protected_pairs: int, host_slots: int | None = None,
                    headroom_blocks: int = 0) -> Callable[[list[S], S], bool]:
    """``admits(admitted, candidate)`` for a scheduler: True when nothing is admitted yet (an oversized request
    still runs alone) or when the admitted sequences and the candidate fit at their BASE floors. Demotion lags
    the step that needs it by up to a batch; ``headroom_blocks`` = 2 x B_min (32) removed the last preemptions
    in simulation (1024 / 256 tokens at concurrency 64 on 2,384 blocks: 2 preemptions at 0 and 16, none at 32,
    and no change in the full-size runs, whose P90 TTFT rose from 5 s to 18 s at 128). It never exceeds a sixteenth
    of the pool: the demo's 48-block pool would otherwise keep 32 blocks back and admit one request at a time."""

    def admits(admitted: list[S], candidate: S) -> bool:
        if not admitted:
            return True
        finals = [final_length(s) for s in admitted]
        finals.append(final_length(candidate))
        capacity = capacity_blocks()
        headroom = min(headroom_blocks, capacity // 16)
        return fits_at_base(finals, capacity, block_size, protected_pairs, host_slots, headroom)

    return admits
