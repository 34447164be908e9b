"""What ends a request after a sampled token: stop token ids and EOS (not before ``min_tokens``), a guided
request's completed or dead grammar, stop strings (matched on the detokenized text), ``max_tokens`` and the model's
context length. No torch."""

from __future__ import annotations

from typing import Any

from elastiserve.engine.sequence import Sequence
from elastiserve.engine.tokenizer import StopStringMatcher


class StopRules:
    def __init__(self, eos_token_ids: frozenset[int], tokenizer: Any, max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._matchers: dict[str, StopStringMatcher] = {}  # requests with stop strings

    def reason(self, seq: Sequence, num_output: int) -> str | None:
        """``"stop"``, ``"length"`` or None for ``seq`` whose last token was just appended; ``num_output``: its output
        tokens, that one included. A stop string match sets ``seq.output_text`` (the text up to the match)."""
        params, token = seq.params, seq.token_ids[-1]
        below_min = num_output < params.min_tokens  # max_tokens >= min_tokens: no length stop either
        stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        if stop_token and not below_min:
            return "stop"
        if seq.guide is not None and (seq.guide.done or seq.guide.dead):  # only EOS could follow: end here
            return "stop"
        if params.stop and self.tokenizer is not None:
            matcher = self._matchers.get(seq.request_id)
            if matcher is None:
                matcher = self._matchers[seq.request_id] = StopStringMatcher(self.tokenizer, params.stop)
            if below_min:
                matcher.release(seq.output_token_ids)
            elif matcher.add(seq.output_token_ids):
                seq.output_text = matcher.text
                return "stop"
        if num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)


def eos_ids_of(tokenizer: Any, hf_config: dict) -> set[int]:
    """The tokenizer's EOS ids and the model config's ``eos_token_id`` (an id or a list)."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
    eos = hf_config.get("eos_token_id")
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids
