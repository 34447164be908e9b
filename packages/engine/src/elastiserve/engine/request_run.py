"""One request's choice as its outputs arrive: timing, text (stop strings held back and cut), logprobs, and the
split of a chat stream's text into reasoning, content and tool-call deltas (``engine.reasoning``,
``tool_calls.ToolCallStream``); what ``server_generation`` and ``server_stream`` write from."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from elastiserve.engine import responses, tool_calls
from elastiserve.engine.protocol import ParsedRequest
from elastiserve.engine.reasoning import ReasoningStream
from elastiserve.engine.tokenizer import StopChecker, TextStream

if TYPE_CHECKING:
    from elastiserve.engine.server_generation import ServerState


class RequestRun:
    """Timing, text and stop handling of one request as its outputs arrive."""

    def __init__(self, state: ServerState, req: ParsedRequest, prompt_len: int, index: int = 0,
                 prompt_index: int = 0) -> None:
        self.state, self.req, self.prompt_len, self.index = state, req, prompt_len, index
        self.prompt_index = prompt_index  # which prompt of a batch this run continues
        self.text = TextStream(state.tokenizer, state.eos_ids, req.skip_special_tokens)
        self.stops = StopChecker(req.stop, include=req.include_stop_str)
        self.tool_stream = tool_calls.ToolCallStream(req.tools) if req.tools is not None and req.stream else None
        chat_stream = req.kind == "chat" and req.stream
        self.reasoning = ReasoningStream(state.reasoning) if chat_stream and state.reasoning is not None else None
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.queue_s: float | None = None
        self.pending_logprobs: list[Any] = []  # TokenLogprobs not yet sent
        self.prompt_logprobs_taken = False  # an echoed stream sends the prompt's with the echo chunk
        self.text_offset = 0  # completions' logprobs: where the next token's text starts in the choice's text
        self.sum_logprob = 0.0  # of the tokens fed, under the raw distribution (best_of's ranking)
        self.scored_tokens = 0

    def feed(self, output: Any) -> str:
        """New text that is safe to send; sets ``finish_reason`` when the request ends (engine or stop string)."""
        now = time.perf_counter()
        new_ids = list(output.new_token_ids)
        self.take_prompt(output)
        new_logprobs = getattr(output, "logprobs", None) or []
        self.pending_logprobs += new_logprobs
        for entry in new_logprobs:
            if entry.logprob is not None:
                self.sum_logprob += entry.logprob
                self.scored_tokens += 1
        if new_ids:
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
            self.num_output_tokens += len(new_ids)
        if self.queue_s is None:
            self.queue_s = queue_time(getattr(output, "metrics", None))
        delta = self.text.add(new_ids, final=bool(output.finished))
        if self.num_output_tokens < self.req.sampling.get("min_tokens", 0) and not output.finished:
            return delta  # vLLM's min_tokens: no stop string counts before it (the engine ignores them too)
        text, stopped = self.stops.feed(delta, final=bool(output.finished))
        if stopped:
            self.finish_reason = "stop"
        elif output.finished:
            self.finish_reason = output.finish_reason or "stop"
            if self.finish_reason == "abort":
                self.finish_reason = "stop"
        return text

    @property
    def mean_logprob(self) -> float:
        """Log-probability per scored token: OpenAI's "best" of ``best_of`` (an empty candidate ranks last)."""
        return self.sum_logprob / self.scored_tokens if self.scored_tokens else float("-inf")

    def take_prompt(self, output: Any) -> None:
        """Queue the prompt's logprobs (echo with logprobs) ahead of the generated tokens', once."""
        prompt = getattr(output, "prompt_logprobs", None)
        if prompt and not self.prompt_logprobs_taken:
            self.pending_logprobs += prompt
            self.prompt_logprobs_taken = True

    def take_logprobs(self) -> dict | None:
        """The logprobs object of the tokens fed since the last call (None if there are none or none were asked)."""
        if not self.pending_logprobs:
            return None
        decode = self.state.tokenizer.decode
        body = responses.logprobs_body(self.req, self.pending_logprobs, lambda token_id: decode([token_id]),
                                      self.text_offset)
        if body is not None and "tokens" in body:
            self.text_offset += sum(len(t) for t in body["tokens"])
        self.pending_logprobs = []
        return body

    @property
    def splits_output(self) -> bool:
        """Whether the stream's text goes out as deltas of reasoning, content and tool calls, not plain text."""
        return self.tool_stream is not None or self.reasoning is not None

    def split(self, text: str) -> list[dict[str, Any]]:
        """The chunk deltas of new ``text`` (all that is left once the request has finished): reasoning first split
        from content, then content read for tool calls."""
        final = self.finish_reason is not None
        pieces = self.reasoning.feed(text) if self.reasoning is not None else [{"content": text}]
        if final and self.reasoning is not None:
            pieces += self.reasoning.finish()
        if self.tool_stream is None:
            return pieces
        deltas = []
        for piece in pieces:
            deltas += self.tool_stream.feed(piece["content"]) if "content" in piece else [piece]
        return deltas + (self.tool_stream.finish() if final else [])

    def record(self) -> None:
        m = self.state.metrics
        ttft = self.first_token_at - self.start if self.first_token_at else None
        tpot = None
        if self.num_output_tokens > 1 and self.first_token_at and self.last_token_at:
            tpot = (self.last_token_at - self.first_token_at) / (self.num_output_tokens - 1)
        m.observe_request(ttft_s=ttft, tpot_s=tpot, queue_s=self.queue_s, e2e_s=time.perf_counter() - self.start,
                          prompt_tokens=self.prompt_len, output_tokens=self.num_output_tokens)


def queue_time(metrics: Any) -> float | None:
    """Seconds from arrival to first scheduling, from a ``SequenceMetrics`` (None until it was scheduled)."""
    if metrics is None:
        return None
    arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
    if arrival is None or scheduled is None:
        return None
    return float(scheduled) - float(arrival)


def prompt_text(state: ServerState, req: ParsedRequest, index: int = 0) -> str:
    prompt = req.prompts[index]
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(list(prompt))
