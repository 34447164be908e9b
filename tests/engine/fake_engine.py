"""A tiny stand-in with the `LLMEngine` surface, for server, async-engine and bench tests that need no model.

Tokens are UTF-8 bytes (ids 0..255) plus specials; every request answers with the bytes of a fixed script (so
outputs are predictable), one token per step, and holds ``ceil(tokens / block_size)`` KV blocks from a fixed pool
while it runs; a request that cannot get its blocks waits (overload queues). ``fail_next_step`` makes the next
``step()`` raise, ``step_delay_s`` slows steps so a client can disconnect mid-stream.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from elastiserve.engine.outputs import RequestOutput
from elastiserve.engine.sequence import SequenceMetrics

EOS = 256
VOCAB = 260
SCRIPT = "Hello from the fake engine: é, ☃ and 😀 are multi-byte. The end."


class ByteTokenizer:
    vocab_size = VOCAB
    eos_token_ids = (EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:  # specials have no text either way
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        header = "".join(f"[{name}={value}]" for name, value in sorted(variables.items()))  # chat_template_kwargs
        text = header + "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeRequest:
    request_id: str
    prompt: list[int]
    params: object
    arrival: float
    output: list[int] = field(default_factory=list)
    blocks: int = 0
    first_scheduled: float | None = None


@dataclass
class FakeConfig:
    max_model_len: int = 512
    block_size: int = 4


class FakeEngine:
    def __init__(self, num_blocks: int = 64, max_num_seqs: int = 4, step_delay_s: float = 0.0,
                 script: str = SCRIPT) -> None:
        self.config = FakeConfig()
        self.max_model_len = self.config.max_model_len
        self.vocab_size = VOCAB
        self.tokenizer = ByteTokenizer()
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.step_delay_s = step_delay_s
        self.script = list(script.encode("utf-8"))
        self.waiting: list[FakeRequest] = []
        self.running: list[FakeRequest] = []
        self.used_blocks = 0
        self.prefix_leaders: dict[str, str | None] = {}  # request id -> the prefix_leader it was added with
        self.fail_next_step = False
        self.num_steps = 0
        self.aborted: list[str] = []
        self.background_steps = 0  # steps of restore/promotion work left; each step() does one
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def add_request(self, request_id, prompt_token_ids, params, arrival_time=None, prefix_leader=None,
                    priority=0) -> None:
        params.validate(VOCAB, self.max_model_len, len(prompt_token_ids))
        if any(r.request_id == request_id for r in self.waiting + self.running):
            raise ValueError(f"duplicate request id {request_id}")
        self.prefix_leaders[request_id] = prefix_leader
        self.waiting.append(FakeRequest(request_id, list(prompt_token_ids), params, arrival_time or time.monotonic()))

    def abort_request(self, request_id) -> None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self.used_blocks -= req.blocks
                    self.aborted.append(request_id)
                    return
        raise KeyError(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_for(self, req: FakeRequest) -> int:
        return math.ceil((len(req.prompt) + len(req.output) + 1) / self.config.block_size)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self._blocks_for(req)
            if self.used_blocks + need > self.num_blocks:
                return
            self.waiting.pop(0)
            req.blocks = need
            self.used_blocks += need
            req.first_scheduled = time.monotonic()
            self.running.append(req)

    def has_background_work(self) -> bool:
        return self.background_steps > 0

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        self.background_steps = max(0, self.background_steps - 1)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self._admit()
        outputs = []
        for req in list(self.running):
            outputs.append(self._advance(req))
        return outputs

    def _advance(self, req: FakeRequest) -> RequestOutput:
        params = req.params
        i = len(req.output)
        token = self.script[i % len(self.script)] if (params.ignore_eos or i < len(self.script)) else EOS
        req.output.append(token)
        need = self._blocks_for(req)
        self.used_blocks += need - req.blocks
        req.blocks = need
        reason = None
        if token == EOS or token in params.stop_token_ids:
            reason = "stop"
        elif len(req.output) >= params.max_tokens:
            reason = "length"
        if reason:
            self.running.remove(req)
            self.used_blocks -= req.blocks
        metrics = SequenceMetrics(arrival_time=req.arrival, first_scheduled_time=req.first_scheduled)
        return RequestOutput(req.request_id, [token], reason is not None, reason, len(req.prompt), len(req.output),
                             metrics)

    def stats(self) -> dict:
        return {"num_total_blocks": self.num_blocks, "num_used_blocks": self.used_blocks,
                "kv_usage": self.used_blocks / self.num_blocks, "num_running": len(self.running),
                "num_waiting": len(self.waiting), "mode": "full", "base_exposure": 0.0, "transitions": 0,
                "preemptions": 0}
