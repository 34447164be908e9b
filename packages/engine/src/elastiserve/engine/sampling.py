"""Per-request sampling parameters, validated against the model before a request is admitted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from elastiserve.engine.errors import InvalidRequest

INT64_END = 2**63  # seed and top_k are int64 on the device


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_k: int = -1  # -1: all tokens
    top_p: float = 1.0
    min_p: float = 0.0  # vLLM's: drop tokens less likely than min_p x the most likely one (0: off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string ends the request before this many tokens
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob given the ones before it, and N more
    presence_penalty: float = 0.0  # OpenAI: minus this from the logit of every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often the token was generated
    repetition_penalty: float = 1.0  # HF / vLLM: logits of prompt and generated tokens divided (> 0) or multiplied
    # OpenAI's logit_bias as (token id, bias) pairs: added to the logits before greedy or sampling
    logit_bias: tuple[tuple[int, float], ...] = ()
    # structured output: a `guided.Grammar` the output must match (None: unconstrained). Each request gets its own
    # `guided.Guide` over it, which masks the tokens that would break the grammar, greedy rows included
    guide: Any = None

    def __post_init__(self) -> None:
        # Lists from JSON bodies become tuples so the params stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int, max_model_len: int, prompt_len: int) -> None:
        """Raise InvalidRequest with a message a client can act on; return None when servable."""
        if not self.temperature >= 0.0:  # NaN too
            raise InvalidRequest(f"temperature={self.temperature} must be >= 0")
        if self.top_k == 0 or not -1 <= self.top_k < INT64_END:  # past int64 a step's top-k tensor fails, batch-wide
            raise InvalidRequest(f"top_k={self.top_k} must be -1 (disabled) or between 1 and 2^63 - 1")
        if self.seed is not None and not -INT64_END <= self.seed < INT64_END:  # so does the step's generator
            raise InvalidRequest(f"seed={self.seed} must be a 64-bit signed integer")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p={self.top_p} must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p={self.min_p} must be in [0, 1]")
        bad_bias = [(t, b) for t, b in self.logit_bias if not 0 <= t < vocab_size or not -100.0 <= b <= 100.0]
        if bad_bias:
            raise InvalidRequest(f"logit_bias {bad_bias[:5]}: token ids must be in [0, {vocab_size}) and biases in "
                                 "[-100, 100]")
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise InvalidRequest(f"max_tokens={self.max_tokens} must be >= 1 (0 only scores the prompt, with "
                                 "prompt_logprobs)")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens={self.min_tokens} must be between 0 and max_tokens ({self.max_tokens})")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequest(f"prompt_logprobs={self.prompt_logprobs} must be between 0 and 20")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequest(f"repetition_penalty={self.repetition_penalty} must be in (0, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequest(f"logprobs={self.logprobs} must be between 0 and 20")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids {bad} are outside the vocabulary of {vocab_size} tokens")
        if prompt_len < 1:
            raise InvalidRequest("the prompt is empty")
        if prompt_len + self.max_tokens > max_model_len:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds max_model_len {max_model_len}"
            )


def choice_params(params: Any, index: int) -> Any:
    """Choice ``index`` of a request's ``n`` (server and ``generate`` alike): a seeded request's choices draw from
    seeds ``seed + index``, so each differs and each can be replayed alone."""
    if index == 0 or getattr(params, "seed", None) is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def best_candidates(candidates: list[Any], n: int) -> list[int]:
    """The indices of the ``n`` of ``best_of`` candidates (anything with a ``mean_logprob``, the log-probability per
    scored token, -inf for none) of the highest score, best first; ties: the lower index."""
    return sorted(range(len(candidates)), key=lambda i: (-candidates[i].mean_logprob, i))[:n]
