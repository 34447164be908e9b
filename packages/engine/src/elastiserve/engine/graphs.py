"""CUDA graphs for decode steps, keyed by (padded batch size, fast layers, attention path).

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


@dataclass(slots=True)
class CapturedStep:
    batch_size: int
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # output buffer of the captured forward, [batch_size, H]

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.hidden


GraphKey = tuple[int, frozenset[int], int]  # (padded batch size, fast layers, attention path)


class GraphRunner:
    def __init__(self, runner: Any, sizes: list[int], capture_after: int = 1) -> None:
        self.runner = runner
        self.sizes = sizes
        self.capture_after = capture_after
        self.graphs: dict[GraphKey, CapturedStep] = {}
        self._uses: Counter[GraphKey] = Counter()
        self._pool: Any = None

    def padded_size(self, num_seqs: int, is_decode: bool) -> int | None:
        """The captured size a decode-only batch pads to; None for prefill steps or batches beyond the largest."""
        if not is_decode:
            return None
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, batch_size: int, metadata: Any) -> torch.Tensor:
        """The hidden states of a padded decode step whose inputs are loaded: a replay of its graph, or an eager
        forward on the same inputs while the key has been used fewer than ``capture_after`` times."""
        key = (batch_size, self.runner.fast_layers, metadata.path)
        step = self.graphs.get(key)
        if step is None:
            self._uses[key] += 1
            if self._uses[key] < self.capture_after:
                return self.runner.forward(batch_size, metadata)
            del self._uses[key]
            step = self.get(batch_size, metadata.path)
        return step.replay()

    def get(self, batch_size: int, path: int) -> CapturedStep:
        key = (batch_size, self.runner.fast_layers, path)
        step = self.graphs.get(key)
        if step is None:
            step = self._capture(batch_size, path)
            self.graphs[key] = step
        return step

    def capture_common(self, paths: tuple[int, ...] = (0,)) -> None:
        """Capture the graph of every size on each attention path in the runner's current mode, with inputs that
        write nothing."""
        for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its pool
            for path in paths:
                self.runner.buffers.reset_for_capture(size)
                self.get(size, path)

    def _capture(self, batch_size: int, path: int) -> CapturedStep:
        r = self.runner
        metadata = r.buffers.metadata_view(batch_size, batch_size, 1, path)
        r.forward(batch_size, metadata)  # warm-up: runs the step (kernels compile/autotune outside capture)
        torch.cuda.synchronize(r.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = r.forward(batch_size, metadata)
        if self._pool is None:
            self._pool = graph.pool()
        log.debug("captured decode graph: batch %d, fast layers %d, path %d", batch_size, len(r.fast_layers), path)
        return CapturedStep(batch_size, graph, hidden)
