"""What the engine hands back: one ``RequestOutput`` per sampled token, one ``CompletionResult`` per ``generate``."""

from __future__ import annotations

from dataclasses import dataclass

from elastiserve.engine.sequence import SequenceMetrics


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability under the model's raw distribution (before penalties, temperature, top-k
    and top-p, as vLLM reports by default), and the ``SamplingParams.logprobs`` most likely tokens with theirs."""

    token_id: int
    logprob: float | None  # None for a prompt's first token, which nothing predicts
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: SequenceMetrics
    text: str | None = None  # full output text, set when finished and a tokenizer is present
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token, on the first output, when asked


@dataclass(frozen=True, slots=True)
class CompletionResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    metrics: SequenceMetrics
