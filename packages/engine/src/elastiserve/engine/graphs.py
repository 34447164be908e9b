"""CUDA graphs for decode steps (and optionally mixed ones), keyed by (padded shape, fast layers, attention path).

A decode step of B sequences is padded to the next captured size; the graph reads the runner's preallocated input
and metadata buffers, so a replay only needs those buffers refilled. Graphs are captured lazily the first time a key
is seen (the warm-up run before capture executes the step for real, so the first use costs one extra forward);
``capture_common`` captures every size on the given paths in the current mode up front (the runner calls it for
the modes and paths its policy reaches). All graphs share one memory pool.

A key first met mid-run (a per-layer mix of full and fast layers) runs eagerly on the same padded inputs until
its ``capture_after``-th use, and only then is captured. On the H200 (session 6) combined's MoE run at 12 req/s
evicted four layers at a time and met 8 mixes; six decode steps of 2-15 sequences took 0.25-0.26 s, all at a
mix's first steps, where its other decode steps took a median 31 ms (a capture inside the step; not profiled). A
key that a mix uses once or twice is not worth a capture; the threshold is a guess, not measured.

With ``EngineConfig.mixed_graphs`` a step that carries prefill chunks is padded to a token bucket and a sequence
bucket (``mixed_token_buckets``, ``mixed_seq_buckets``) and replays a graph of that key too, captured behind the
same gate. Its padding tokens belong to no sequence (slot -1, so nothing is written; attention leaves their rows
unset and every other op is row-wise) and its padding sequences have no queries; attention's grid is sized by the
token bucket (``max_query_len``), as an eager step of a chunk that long sizes it. Eagerly, such a MoE step took
86-94 ms of host time whatever its chunk (benchmarks/engine/results/h200-mixed-step-profile-run1.*); from graphs
51 / 75 / 83 ms for chunks of 512 / 1,024 / 2,048 tokens (run2, power-of-two buckets then). Captured lazily
mid-run, the MoE headline's steps of 200-250 ms (one capture each) broke the TBT bound of half of static-fp16's
requests at 4 req/s (benchmarks/serving/results/moe-mixed-graphs-run1), so the native path's mixed graphs are now
captured before serving, with the decode graphs.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


MIXED_MIN_TOKENS = 256  # smallest token bucket of a mixed step


def _doublings(start: int, top: int) -> list[int]:
    """start, 2 x start, ... below ``top``, then ``top`` itself."""
    sizes, size = [], start
    while size < top:
        sizes.append(size)
        size *= 2
    return [*sizes, top]


def mixed_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """256 and 512, then steps of a quarter of the power of two below (256 up to 2,048, 512 up to 4,096, ...), then
    the step's token budget itself: at most 255 padding tokens, or a quarter of the step above 1,024.

    Padding is not free. A 1,024-token chunk beside a decode batch of 64 is a 1,088-token step; padded to the next
    power of two, 2,048, it took 75 ms from its graph on the H200 against 83 ms for a real 2,048-token chunk (static
    fp16 Qwen3-30B-A3B, benchmarks/engine/results/h200-mixed-step-profile-run2). Its padding rows went through the
    MoE then, all to the same experts; they now route to none (``AttentionMetadata.padded``, ``moe_experts``)."""
    sizes = [s for s in (MIXED_MIN_TOKENS, 2 * MIXED_MIN_TOKENS) if s < max_num_batched_tokens]
    size = 2 * MIXED_MIN_TOKENS
    while True:
        size += max(MIXED_MIN_TOKENS, (1 << (size.bit_length() - 1)) // 4)
        if size >= max_num_batched_tokens:
            return [*sizes, max_num_batched_tokens]
        sizes.append(size)


def mixed_seq_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two from 16 (a mixed graph's attention grid grows with its sequences), then ``max_num_seqs``."""
    return _doublings(16, max_num_seqs)


def _bucket(sizes: list[int], n: int) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step is padded to: ``tokens`` rows of input, ``batch`` sequences; ``mixed`` when it carries prefill
    chunks (its attention grid is sized for ``tokens`` queries), else a decode step of one token per sequence."""

    tokens: int
    batch: int
    mixed: bool = False

    @property
    def max_query_len(self) -> int:
        return self.tokens if self.mixed else 1


@dataclass(slots=True)
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # output buffer of the captured forward, [tokens, H]

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.hidden


GraphKey = tuple[StepShape, frozenset[int], int]  # (padded shape, fast layers, attention path)


class GraphRunner:
    def __init__(self, runner: Any, sizes: list[int], capture_after: int = 1,
                 mixed_buckets: tuple[list[int], list[int]] | None = None) -> None:
        self.runner = runner
        self.sizes = sizes
        self.capture_after = capture_after
        self.mixed_buckets = mixed_buckets  # (token buckets, sequence buckets); None: mixed steps run eagerly
        self.graphs: dict[GraphKey, CapturedStep] = {}
        self._uses: Counter[GraphKey] = Counter()
        self._pool: Any = None

    def step_shape(self, num_tokens: int, num_seqs: int, is_decode: bool) -> StepShape | None:
        """The padded shape a step replays a graph of, or None when it runs eagerly."""
        if is_decode:
            size = _bucket(self.sizes, num_seqs)
            return StepShape(size, size) if size is not None else None
        if self.mixed_buckets is None:
            return None
        tokens, batch = _bucket(self.mixed_buckets[0], num_tokens), _bucket(self.mixed_buckets[1], num_seqs)
        return StepShape(tokens, batch, mixed=True) if tokens is not None and batch is not None else None

    def run(self, shape: StepShape, metadata: Any) -> torch.Tensor:
        """The hidden states of a padded step whose inputs are loaded: a replay of its graph, or an eager forward on
        the same inputs while the key has been used fewer than ``capture_after`` times."""
        key = (shape, self.runner.fast_layers, metadata.path)
        step = self.graphs.get(key)
        if step is None:
            self._uses[key] += 1
            if self._uses[key] < self.capture_after:
                return self.runner.forward(shape.tokens, metadata)
            del self._uses[key]
            step = self.get(shape, metadata.path)
        return step.replay()

    def get(self, shape: StepShape, path: int, warm_up: bool = True) -> CapturedStep:
        key = (shape, self.runner.fast_layers, path)
        step = self.graphs.get(key)
        if step is None:
            step = self._capture(shape, path, warm_up)
            self.graphs[key] = step
        return step

    def capture_common(self, paths: tuple[int, ...] = (0,), warm_up: bool = True) -> None:
        """Capture the decode graph of every size on each attention path in the runner's current mode, and with mixed
        buckets the mixed graph of every (tokens, sequences) bucket on the first path (the native one: a mixed
        step next to BASE pairs is rarer, and waits for ``capture_after`` uses), all with inputs that write
        nothing. Largest first, so that smaller graphs fit in its pool. ``warm_up=False`` skips the eager forward
        before each capture: for a mix of layers whose every kernel, shape and mode the whole-model modes' captures
        already ran (see ``_capture``)."""
        shapes = [(StepShape(size, size), path) for size in reversed(self.sizes) for path in paths]
        if self.mixed_buckets is not None:
            token_buckets, seq_buckets = self.mixed_buckets
            shapes = [(StepShape(t, b, mixed=True), paths[0]) for t in reversed(token_buckets)
                      for b in reversed(seq_buckets) if b <= t] + shapes
        for shape, path in shapes:
            self.runner.buffers.reset_for_capture(shape.tokens, shape.batch)
            self.get(shape, path, warm_up)

    def _capture(self, shape: StepShape, path: int, warm_up: bool = True) -> CapturedStep:
        """The warm-up forward compiles and autotunes kernels outside the capture. It is about half of a capture's
        host time: combined's five layer-group prefixes on the MoE model took 196 s for 500 graphs with it
        (0.39 s each, H200, session 10), so the prefixes between all-full and all-fast go without."""
        r = self.runner
        metadata = r.buffers.metadata_view(shape.tokens, shape.batch, shape.max_query_len, path, padded=shape.mixed)
        if warm_up:
            r.forward(shape.tokens, metadata)
        torch.cuda.synchronize(r.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = r.forward(shape.tokens, metadata)
        if self._pool is None:
            self._pool = graph.pool()
        log.debug("captured graph: %s, fast layers %d, path %d", shape, len(r.fast_layers), path)
        return CapturedStep(graph, hidden)
