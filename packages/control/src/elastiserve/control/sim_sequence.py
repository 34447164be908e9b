"""A simulated sequence: its KV block table with pair fidelity, and the pair bookkeeping the control plane reads."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from elastiserve.control.metrics import RequestRecord
from elastiserve.control.observation import PairInfo
from elastiserve.control.workloads import Request


@dataclass(slots=True)
class PromotionInFlight:
    pair: int
    fresh_blocks: list[int]
    ready_at: float


@dataclass(slots=True)
class SimSequence:
    """``blocks[i]`` is the physical block of logical block i; a BASE pair lists its packed block for both halves.
    ``computed`` counts tokens whose KV is in the cache; ``generated`` counts output tokens emitted."""

    request: Request
    record: RequestRecord
    computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    base_pairs: set[int] = field(default_factory=set)
    promoting: dict[int, PromotionInFlight] = field(default_factory=dict)
    last_used_step: int = 0
    prefill_target: int = 0
    state: str = "waiting"

    def __post_init__(self) -> None:
        self.prefill_target = self.request.prompt_tokens

    @property
    def seq_id(self) -> int:
        return self.request.req_id

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_target

    @property
    def remaining_prompt(self) -> int:
        return self.prefill_target - self.computed

    def status(self) -> str:
        if self.prefilling:
            return "prefilling"
        if self.request.output_tokens - self.generated <= 2:
            return "finishing"
        return "decoding"

    def blocks_needed(self, new_tokens: int, block_size: int) -> int:
        return max(0, -(-(self.computed + new_tokens) // block_size) - len(self.blocks))

    def physical_blocks(self) -> list[int]:
        """Every physical block the sequence holds, each once (BASE pairs hold one, promotions two more)."""
        out, seen = [], set()
        for b in self.blocks:
            if b not in seen:
                seen.add(b)
                out.append(b)
        for promo in self.promoting.values():
            out.extend(promo.fresh_blocks)
        return out

    def complete_pairs(self, block_size: int) -> int:
        """Pairs whose two blocks are full: only those can change fidelity."""
        return (self.computed // block_size) // 2

    def demotable_range(self, block_size: int, sink: int, recent: int) -> range:
        return range(sink, max(sink, self.complete_pairs(block_size) - recent))

    def eligible_pairs(self, block_size: int, sink: int, recent: int) -> int:
        # Every BASE pair (promoting ones included) lies in the demotable range: it was in it when demoted, the
        # range only grows while the sequence lives, and preemption clears both.
        return max(0, len(self.demotable_range(block_size, sink, recent)) - len(self.base_pairs))

    def pair_infos(self, block_size: int, sink: int, recent: int) -> Iterator[PairInfo]:
        """Demotable TARGET pairs in ranking order (lowest index first), generated lazily."""
        status = self.status()
        for p in self.demotable_range(block_size, sink, recent):
            if p not in self.base_pairs:
                yield PairInfo(self.seq_id, p, self.last_used_step, status)

    def remaining_prefill_blocks(self, block_size: int) -> int:
        """Blocks an admitted, partly prefilled sequence will still take: already committed capacity."""
        return max(0, -(-self.prefill_target // block_size) - len(self.blocks)) if self.prefilling else 0

    def demote(self, pair: int) -> int:
        """TARGET -> BASE in place into block 2p; returns block 2p+1, which goes back to the pool."""
        released = self.blocks[2 * pair + 1]
        self.blocks[2 * pair + 1] = self.blocks[2 * pair]
        self.base_pairs.add(pair)
        return released

    def publish_promotion(self, pair: int) -> int:
        """BASE -> TARGET: the two fresh blocks replace the packed one, which is returned to be freed."""
        promo = self.promoting.pop(pair)
        packed = self.blocks[2 * pair]
        self.blocks[2 * pair], self.blocks[2 * pair + 1] = promo.fresh_blocks
        self.base_pairs.discard(pair)
        return packed

    def visible_pairs(self) -> int:
        return (len(self.blocks) + 1) // 2

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all KV; output produced so far is kept, the context is rebuilt later."""
        self.prefill_target = self.request.prompt_tokens + self.generated
        self.computed = 0
        self.blocks = []
        self.base_pairs = set()
        self.promoting = {}
        self.record.preemptions += 1
