"""Logical KV blocks, pair fidelity states and host-backing slots; plain Python, no torch.

Logical blocks ``2p, 2p+1`` of a sequence form pair ``p``. TARGET holds two physical blocks; BASE holds one packed
block listed for both logical blocks, with the low bytes of both in one host-backing slot; PROMOTING is still BASE for
every reader while two fresh blocks are reserved, and becomes TARGET only when the runner reports the unpack done.
Physical blocks come from a ``BlockPool`` (``block_pool.py``), wrapped by the prefix cache's pool when caching is on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastiserve.engine.block_pool import BlockPool, FlatBlockPool, SumBlockPool
from elastiserve.engine.errors import EngineError
from elastiserve.engine.pair_ops import BaseRun, DemoteOp, PromoteOp
from elastiserve.engine.prefix_cache import CachingBlockPool, PrefixCache, cached_run, hash_at
from elastiserve.engine.sequence import PairState, Sequence

if TYPE_CHECKING:
    from elastiserve.control.admission import BaseFloorBound

__all__ = ["BlockPool", "FlatBlockPool", "KVManager", "SumBlockPool"]  # the pools moved to block_pool.py


@dataclass(slots=True)
class ExposureCounter:
    base_tokens: int = 0
    attended_tokens: int = 0

    @property
    def ratio(self) -> float:
        return self.base_tokens / self.attended_tokens if self.attended_tokens else 0.0


class KVManager:
    def __init__(
        self, pool: BlockPool, block_size: int, num_host_slots: int, *, sink_pairs: int = 1, recent_pairs: int = 2,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.prefix_cache = prefix_cache
        self.pool = pool if prefix_cache is None else CachingBlockPool(pool, prefix_cache)
        self.block_size = block_size
        self.sink_pairs = sink_pairs
        self.recent_pairs = recent_pairs
        self.allow_backed = False  # set by the engine from the policy each step
        self.num_host_slots = num_host_slots
        self._free_slots: deque[int] = deque(range(num_host_slots))
        self._slots: dict[tuple[str, int], int] = {}  # (request, pair) -> host slot of a BASE/PROMOTING pair
        self._promotions: dict[tuple[str, int], PromoteOp] = {}
        self._base_runs: dict[str, BaseRun] = {}  # request -> its BASE/PROMOTING pairs, for requests with any
        self.exposure = ExposureCounter()
        self.num_demotions = 0
        self.num_promotions = 0

    def admission_bound(self, control: Any, max_model_len: int) -> BaseFloorBound[Sequence] | None:
        """The scheduler's admission bound for ``control.kv.admission == "base-floor"`` (None otherwise): every
        admitted request must fit at prompt + max_tokens (clipped) with its unprotected pairs in BASE, in the blocks
        KV can have (every unit, when the policy may evict residuals)."""
        from elastiserve.control.admission import BaseFloorBound

        if control is None or control.kv.admission != "base-floor":
            return None
        clip = control.kv.admission_output_clip

        def capacity() -> int:  # every unit, or counts()["kv_blocks"] without the rest of counts()
            if control.uses_eviction:
                return self.pool.num_blocks
            return self.pool.num_allocated() + self.pool.num_free(False)

        def final_length(seq: Sequence) -> int:
            return min(max_model_len, seq.num_prompt_tokens + min(seq.params.max_tokens, clip))

        return BaseFloorBound(capacity, final_length, self.block_size, self.sink_pairs + self.recent_pairs,
                              self.num_host_slots, headroom_blocks=2 * control.kv.b_min)

    # ---- allocation ------------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def num_free_blocks(self) -> int:
        return self.pool.num_free(self.allow_backed)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks()

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens; False (and no change) when the pool is short."""
        n = self.blocks_needed(seq, num_new_tokens)
        if n == 0:
            return True
        blocks = self.pool.allocate(n, self.allow_backed)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        num_pairs = -(-len(seq.block_table) // 2)
        seq.pair_states.extend([PairState.TARGET] * (num_pairs - len(seq.pair_states)))
        return True

    def free_sequence(self, seq: Sequence) -> None:
        """Return every block, reserved promotion block and host slot of ``seq`` (finish, abort, preemption); pairs
        the prefix cache holds are released to it instead."""
        blocks = set(seq.block_table)
        for pair, held in enumerate(seq.cache_held):
            if held and self.prefix_cache.release(seq.pair_hashes[pair]) is None:  # still cached: not ours to free
                blocks.difference_update(seq.block_table[2 * pair : 2 * pair + 2])
        seq.cache_held.clear()  # the hash memo stays: the tokens have not changed
        for pair in range(len(seq.pair_states)):
            op = self._promotions.pop((seq.request_id, pair), None)
            if op is not None:
                blocks.update((op.dst_a, op.dst_b))
            slot = self._slots.pop((seq.request_id, pair), None)
            if slot is not None:
                self._free_slots.append(slot)
        self.pool.free(sorted(blocks))
        self._base_runs.pop(seq.request_id, None)
        seq.block_table.clear()
        seq.pair_states.clear()

    # ---- prefix cache ----------------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence that holds no blocks the longest run of cached pairs from its start; returns the tokens
        it no longer computes. One token is always left to compute (the step samples from it), and requests that
        want prompt logprobs compute their whole prompt."""
        pairs = self._cached_pairs(seq)
        if pairs == 0:
            return 0
        for key in seq.pair_hashes[:pairs]:
            seq.block_table.extend(self.prefix_cache.acquire(key))
        seq.pair_states[:] = [PairState.TARGET] * pairs
        seq.cache_held[:] = [True] * pairs
        seq.num_computed_tokens = pairs * 2 * self.block_size
        return seq.num_computed_tokens

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """What ``match_prefix`` would give ``seq`` now, taking nothing (the scheduler's dry run)."""
        return self._cached_pairs(seq) * 2 * self.block_size

    def _cached_pairs(self, seq: Sequence) -> int:
        if self.prefix_cache is None or seq.block_table or seq.params.prompt_logprobs is not None:
            return 0
        return cached_run(self.prefix_cache, seq, 2 * self.block_size)

    def unmatch(self, seq: Sequence) -> None:
        """Undo ``match_prefix`` for a sequence that was not admitted after all."""
        if seq.block_table:
            self.free_sequence(seq)
            seq.num_computed_tokens = 0

    def set_cache_retention(self, retain: bool) -> None:
        """Turn retention of unused cached pairs on or off; turning it off frees what is retained."""
        cache = self.prefix_cache
        if cache is None or cache.retain == retain:
            return
        cache.retain = retain
        if not retain:
            self.pool.inner.free(cache.evict(cache.num_retained_blocks))

    def count_prefix_lookup(self, seq: Sequence, matched_tokens: int) -> None:
        """An admitted sequence's lookup, for the cache's hit counters (retried admissions count once)."""
        if self.prefix_cache is not None and seq.params.prompt_logprobs is None:
            self.prefix_cache.record_lookup(seq.num_tokens, matched_tokens)

    def register_pairs(self, seq: Sequence) -> None:
        """Hand the pairs ``seq`` completed since the last call to the prefix cache (a pair whose content another
        sequence registered first stays the sequence's own)."""
        cache = self.prefix_cache
        if cache is None:
            return
        for pair in range(len(seq.cache_held), self.num_complete_pairs(seq)):
            key = hash_at(seq, pair, 2 * self.block_size)
            held = seq.pair_states[pair] is PairState.TARGET and key not in cache
            if held:
                cache.insert(key, (seq.block_table[2 * pair], seq.block_table[2 * pair + 1]))
            seq.cache_held.append(held)

    # ---- pairs -----------------------------------------------------------------------------------------------
    def num_complete_pairs(self, seq: Sequence) -> int:
        """Pairs whose two blocks are full of computed KV; the partially filled last pair is not complete."""
        return min(seq.num_computed_tokens // (2 * self.block_size), len(seq.block_table) // 2)

    def demotable_pairs(self, seq: Sequence) -> list[int]:
        return list(self.iter_demotable_pairs(seq))

    def iter_demotable_pairs(self, seq: Sequence) -> Iterator[int]:
        """The demotable pairs of ``seq``, oldest first, produced lazily (a demotion ranks a few of them). Each
        next one is found by ``list.index`` (C) because the BASE run sits in front of them: under pressure a
        sequence's first demotable pair follows ~200 BASE ones at 4,096-token contexts."""
        states = seq.pair_states
        pair, end = self.sink_pairs, self.num_complete_pairs(seq) - self.recent_pairs
        while pair < end:
            try:
                pair = states.index(PairState.TARGET, pair, end)
            except ValueError:
                return
            if not self._shared(seq, pair):
                yield pair
            pair += 1

    def _shared(self, seq: Sequence, pair: int) -> bool:
        """Whether other sequences read ``pair`` through the prefix cache (then it is never demoted)."""
        held = seq.cache_held
        return pair < len(held) and held[pair] and self.prefix_cache.refs(seq.pair_hashes[pair]) > 1

    def demotion_stream(self, seq: Sequence, seq_id: int) -> Iterator[Any]:
        """``seq``'s demotable pairs as ``rank_demotable_streams`` takes them: one status and one last use for the
        whole sequence, so pair order is ranking order."""
        from elastiserve.control.observation import PairInfo

        status = "prefilling" if seq.in_prefill else "decoding"
        for pair in self.iter_demotable_pairs(seq):
            yield PairInfo(seq_id, pair, 0, status)

    def is_demotable(self, seq: Sequence, pair: int) -> bool:
        end = self.num_complete_pairs(seq) - self.recent_pairs
        in_range = self.sink_pairs <= pair < end
        return in_range and seq.pair_states[pair] is PairState.TARGET and not self._shared(seq, pair)

    def num_demotable_pairs(self, seq: Sequence) -> int:
        """``len(demotable_pairs(seq))`` without building the list (every step's observation counts them)."""
        end = self.num_complete_pairs(seq) - self.recent_pairs
        if end <= self.sink_pairs:
            return 0
        if any(seq.cache_held):  # shared pairs are not demotable: count them out one by one
            return sum(1 for _ in self.iter_demotable_pairs(seq))
        states = seq.pair_states
        if not states.num_not_target:
            return end - self.sink_pairs
        # Non-TARGET pairs inside [sink, end) are all of them less those in the sink and past ``end`` (a few pairs):
        # no scan of the BASE run between (pair_states.py).
        head, tail = states[: self.sink_pairs], states[end:]
        outside = len(head) - head.count(PairState.TARGET) + len(tail) - tail.count(PairState.TARGET)
        return end - self.sink_pairs - (states.num_not_target - outside)

    @staticmethod
    def promotion_candidates(seqs: Iterable[Sequence]) -> Iterator[tuple[Sequence, int]]:
        """BASE pairs, earliest-arrived requests first (they are the most urgent to restore), produced lazily: a
        promotion takes the first few."""
        for seq in sorted(seqs, key=lambda s: s.arrival_time):
            if seq.pair_states.num_base:
                yield from ((seq, p) for p, st in enumerate(seq.pair_states) if st is PairState.BASE)

    @staticmethod
    def num_promotable_pairs(seqs: Iterable[Sequence]) -> int:
        """How many pairs ``promotion_candidates`` would give, without producing them (every step's observation
        counts them)."""
        return sum(s.pair_states.num_base for s in seqs)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def demote(self, seq: Sequence, pair: int) -> DemoteOp:
        """Mark ``pair`` BASE; the caller packs A, copies the low bytes out, then calls ``release_demoted``."""
        if not self.is_demotable(seq, pair):
            raise EngineError(f"pair {pair} of {seq.request_id} is protected or not TARGET")
        if not self._free_slots:
            raise EngineError("demotion needs a free host-backing slot")
        slot = self._free_slots.popleft()
        if pair < len(seq.cache_held) and seq.cache_held[pair]:  # its only user takes it back from the cache
            self.prefix_cache.forget(seq.pair_hashes[pair])
            seq.cache_held[pair] = False
        block_a, block_b = seq.block_table[2 * pair], seq.block_table[2 * pair + 1]
        seq.block_table[2 * pair + 1] = block_a
        seq.pair_states[pair] = PairState.BASE
        self._base_runs.setdefault(seq.request_id, BaseRun(pair, pair + 1)).add(pair)
        self._slots[(seq.request_id, pair)] = slot
        self.num_demotions += 1
        return DemoteOp(seq.request_id, pair, block_a, block_b, slot)

    def cancel_demote(self, seq: Sequence, op: DemoteOp) -> None:
        """A demotion that never reached the device: the pair is TARGET on its two blocks again, its slot free."""
        if self._slots.pop((seq.request_id, op.pair), None) != op.slot:
            raise EngineError(f"demotion of pair {op.pair} of {seq.request_id} is not pending")
        seq.block_table[2 * op.pair + 1] = op.block_b
        self._back_to_target(seq, op.pair)
        self._free_slots.appendleft(op.slot)
        self.num_demotions -= 1

    def _back_to_target(self, seq: Sequence, pair: int) -> None:
        seq.pair_states[pair] = PairState.TARGET
        run = self._base_runs[seq.request_id]
        run.drop(pair, seq.pair_states)
        if run.count == 0:
            del self._base_runs[seq.request_id]

    def release_demoted(self, ops: Iterable[DemoteOp]) -> None:
        """Return the B blocks once the pack kernels are enqueued (later writes are stream-ordered after them)."""
        self.pool.free([op.block_b for op in ops])

    def begin_promote(self, seq: Sequence, pair: int) -> PromoteOp | None:
        """Reserve two blocks for a BASE pair; None when the pool cannot spare them."""
        if seq.pair_states[pair] is not PairState.BASE:
            raise EngineError(f"pair {pair} of {seq.request_id} is not BASE")
        blocks = self.pool.allocate(2, False)
        if blocks is None:
            return None
        key = (seq.request_id, pair)
        op = PromoteOp(seq.request_id, pair, seq.block_table[2 * pair], blocks[0], blocks[1], self._slots[key])
        seq.pair_states[pair] = PairState.PROMOTING  # still BASE for readers: its BaseRun does not change
        self._promotions[key] = op
        return op

    def finish_promote(self, seq: Sequence, op: PromoteOp) -> None:
        """Publish the unpacked blocks (the runner saw the event complete), then free the packed block and slot."""
        key = (seq.request_id, op.pair)
        if self._promotions.pop(key, None) is not op:
            raise EngineError(f"promotion of pair {op.pair} of {seq.request_id} is not in flight")
        seq.block_table[2 * op.pair] = op.dst_a
        seq.block_table[2 * op.pair + 1] = op.dst_b
        self._back_to_target(seq, op.pair)
        self._free_slots.append(self._slots.pop(key))
        self.pool.free([op.packed_block])
        self.num_promotions += 1

    def cancel_promote(self, seq: Sequence, op: PromoteOp) -> None:
        """A promotion that never reached the device: the pair stays BASE (its slot keeps the low bytes), the two
        reserved blocks go back to the pool."""
        if self._promotions.pop((seq.request_id, op.pair), None) is not op:
            raise EngineError(f"promotion of pair {op.pair} of {seq.request_id} is not in flight")
        seq.pair_states[op.pair] = PairState.BASE
        self.pool.free([op.dst_a, op.dst_b])

    def promotions_in_flight(self) -> list[PromoteOp]:
        return list(self._promotions.values())

    def is_promoting(self, op: PromoteOp) -> bool:
        """Whether ``op`` itself is in flight: by identity, since a promotion abandoned with its sequence (preempted,
        its copy still running) can equal, field for field, the one its recomputed sequence starts later."""
        return self._promotions.get((op.request_id, op.pair)) is op

    # ---- attention metadata and exposure ---------------------------------------------------------------------
    @staticmethod
    def pair_modes(seq: Sequence) -> list[int]:
        """1 for a pair readers must treat as BASE (BASE or PROMOTING), 0 for TARGET; ``[]`` when every pair is
        TARGET (pairs past the end of the list read as TARGET, so the common case costs no per-pair list)."""
        if not seq.has_base_pairs():
            return []
        return [0 if s is PairState.TARGET else 1 for s in seq.pair_states]

    def base_bounds(self, seq: Sequence) -> tuple[int, int] | None:
        """``[first, end)`` of the pairs ``pair_modes`` marks 1 when they are one run ((0, 0) when there are none),
        None when they are not. Kept up to date by every state change, so a step needs no per-pair list: building and
        scanning them held a CPU decode step (batch 58, 4,096-token contexts, 75 % BASE) at 3.7 ms instead of 2.4 ms."""
        run = self._base_runs.get(seq.request_id)
        if run is None:
            return 0, 0
        return (run.first, run.end) if run.contiguous else None

    def base_tokens(self, seq: Sequence, seq_len: int) -> int:
        """KV tokens among the first ``seq_len`` that attention reads from BASE pairs (BASE or PROMOTING).

        Every step calls this for every sequence (exposure). Pairs wholly inside ``seq_len`` are the list's own
        count less the pairs that reach past it (at most the partly filled last one, in practice), which are walked:
        on the CPU a walk over every BASE pair cost ~5 ms per step at batch 58 with 4,096-token contexts, 75 % BASE."""
        states = seq.pair_states
        if not states.num_not_target:
            return 0
        pair_tokens = 2 * self.block_size
        whole = min(seq_len // pair_tokens, len(states))
        past = states[whole:]
        inside = states.num_not_target - (len(past) - past.count(PairState.TARGET))
        tail = sum(max(0, min(seq_len, (p + 1) * pair_tokens) - p * pair_tokens)
                   for p, state in enumerate(past, start=whole) if state is not PairState.TARGET)
        return inside * pair_tokens + tail

    def record_exposure(self, seq: Sequence, seq_len: int) -> None:
        base = self.base_tokens(seq, seq_len)
        self.exposure.base_tokens += base
        self.exposure.attended_tokens += seq_len
        seq.metrics.base_token_reads += base
        seq.metrics.attended_tokens += seq_len

    def counts(self) -> dict[str, int]:
        """``total_blocks``: every block of the pool, including those in units that hold resident weight residuals;
        ``kv_blocks``: the blocks KV can use now (allocated or free, not holding a residual)."""
        free = self.pool.num_free(False)  # with_backed=True would walk every BACKED unit: not per step
        return {
            "free_blocks": free,
            "total_blocks": self.pool.num_blocks,
            "kv_blocks": self.pool.num_allocated() + free,
            "base_pairs": len(self._slots) - len(self._promotions),
            "promoting_pairs": len(self._promotions),
            "free_host_slots": len(self._free_slots),
            "demotions": self.num_demotions,
            "promotions": self.num_promotions,
        }
