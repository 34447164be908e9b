"""Workloads for the benchmark: `elastiserve.control.workloads` request streams plus the prompts that realise them.

Prompts are random token ids of the exact requested length (no tokenizer round trip can change the count), drawn
from a fixed seed and avoiding the end-of-sequence ids; requests run with ``ignore_eos`` so output lengths are exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from elastiserve.control import workloads
from elastiserve.control.workloads import Request
from elastiserve.platforms import ConfigError

KINDS = ("trace", "poisson", "gamma", "fixed")


@dataclass(frozen=True)
class WorkloadSpec:
    """What to replay. ``trace``: a named trace window (timestamps kept and scaled by ``time_scale`` unless ``rate``
    is set); ``poisson``/``gamma``: lengths from ``trace`` (a length table or trace) or fixed, arrivals at ``rate``
    with ``cv`` (poisson forces cv=1); ``fixed``: ``input_len``/``output_len`` for every request at ``rate``."""

    kind: str = "trace"
    trace: str = "azure-window"
    start: int = 0
    count: int | None = 32
    time_scale: float = 1.0
    rate: float | None = None
    cv: float = 2.0
    num_requests: int = 32
    input_len: int = 4096
    output_len: int = 1024
    max_prompt: int | None = None
    max_output: int | None = None
    shared_prefix: int = 0  # every prompt starts with the same this many ids (a system prompt), as far as it reaches
    seed: int = 0
    trace_dir: Path | None = field(default=None)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"workload kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.kind in ("poisson", "gamma", "fixed") and (self.rate is None or self.rate <= 0):
            raise ConfigError(f"workload kind {self.kind!r} needs a positive rate")
        if self.kind == "fixed" and (self.input_len < 1 or self.output_len < 1):
            raise ConfigError("fixed workloads need input_len and output_len >= 1")
        if self.shared_prefix < 0:
            raise ConfigError(f"shared_prefix={self.shared_prefix}: expected >= 0")

    def with_rate(self, rate: float) -> WorkloadSpec:
        import dataclasses

        return dataclasses.replace(self, rate=rate)


def build_requests(spec: WorkloadSpec) -> list[Request]:
    if spec.kind == "fixed":
        requests = workloads.synthetic(spec.num_requests, spec.input_len, spec.output_len, spec.rate, spec.cv,
                                       spec.seed)
    else:
        cv = 1.0 if spec.kind == "poisson" else spec.cv
        requests = workloads.load_trace(spec.trace, spec.start, spec.count, rate=spec.rate, cv=cv, seed=spec.seed,
                                        time_scale=spec.time_scale, trace_dir=spec.trace_dir)
    if spec.max_prompt or spec.max_output:
        requests = workloads.clip_lengths(requests, spec.max_prompt or 1 << 30, spec.max_output or 1 << 30)
    return requests


def make_prompts(requests: list[Request], vocab_size: int, *, avoid: frozenset[int] = frozenset(),
                 seed: int = 0, low: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """One random prompt of exactly ``prompt_tokens`` ids per request; ids in [low, vocab_size) minus ``avoid``.
    The first ``shared_prefix`` ids (or the whole prompt, if shorter) are the same in every prompt."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            t = rng.randrange(low, vocab_size)
            if t not in avoid:
                ids.append(t)
        return ids

    prefix = draw(shared_prefix)
    return [prefix[: r.prompt_tokens] + draw(r.prompt_tokens - min(shared_prefix, r.prompt_tokens)) for r in requests]
