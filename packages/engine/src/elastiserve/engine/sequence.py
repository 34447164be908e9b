"""Plain per-request state shared by the scheduler, the KV manager and the runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from elastiserve.engine.block_table import BlockTable
from elastiserve.engine.pair_states import PairState, PairStates
from elastiserve.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True)
class SequenceMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    base_token_reads: int = 0  # attended KV tokens read from BASE pairs, summed over steps
    attended_tokens: int = 0  # all attended KV tokens, summed over steps
    fast_mode_tokens: int = 0  # output tokens computed with at least one layer in fast mode


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    metrics: SequenceMetrics
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: BlockTable = field(default_factory=BlockTable)  # logical block -> physical block
    pair_states: PairStates = field(default_factory=PairStates)  # one per pair of logical blocks (2p, 2p+1)
    finish_reason: str | None = None
    output_text: str = ""
    prompt_logprobs: list | None = None  # TokenLogprobs of the prompt so far, when its params ask for them
    pair_hashes: list[bytes] = field(default_factory=list)  # prefix-cache chain hashes of leading pairs (a memo)
    cache_held: list[bool] = field(default_factory=list)  # per registered pair: its blocks belong to the prefix cache
    # a request with the same prompt (a sibling of n choices): admitted once that one's prefill is done, so the
    # prefix cache holds the prompt's pairs by then (Scheduler.held_for_leader)
    prefix_leader: str | None = None
    # the tokens the sampler may not pick while fewer than params.min_tokens are generated (EOS and stop tokens)
    banned_before_min: tuple[int, ...] = ()
    guide: Any = None  # a guided.Guide when params.guide is set: its state follows the generated tokens
    priority: int = 0  # priority scheduling: lower runs first (vLLM's convention); ties by arrival

    def __post_init__(self) -> None:
        if not isinstance(self.block_table, BlockTable):  # a plain list given: track it like the default
            self.block_table = BlockTable(self.block_table)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def priority_key(self) -> tuple[int, float]:
        """Order of service under priority scheduling: the lowest first."""
        return self.priority, self.metrics.arrival_time

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to be written to the KV cache; 1 for a decoding sequence (its last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1

    def pair_of(self, logical_block: int) -> int:
        return logical_block // 2

    def has_base_pairs(self) -> bool:
        return self.pair_states.num_not_target > 0  # counted as states change (pair_states.py)

    def base_pairs(self) -> list[int]:
        if not self.has_base_pairs():
            return []
        return [p for p, s in enumerate(self.pair_states) if s is not PairState.TARGET]

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget all KV; prompt and generated tokens are prefilled again."""
        self.num_computed_tokens = 0
        self.block_table.clear()
        self.pair_states.clear()
        self.cache_held.clear()
        self.status = SequenceStatus.WAITING
        self.metrics.preemptions += 1
