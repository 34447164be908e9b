"""A decode graph first needed mid-run is captured only at its ``capture_after``-th use; before that the step runs
eagerly on the same padded inputs. The CPU has no CUDA graphs, so a stub stands in for the capture; the GPU e2e
tests replay real ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastiserve.control.step_model import padded_batch
from elastiserve.engine.config import EngineConfig
from elastiserve.engine.graphs import GraphRunner, StepShape, graph_batch_sizes, mixed_seq_buckets, mixed_token_buckets
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]


class StubRunner:
    def __init__(self):
        self.fast_layers = frozenset()
        self.forwards = []

    def forward(self, num_tokens, metadata):
        self.forwards.append((num_tokens, metadata.path, self.fast_layers))
        return ("eager", num_tokens)


def graph_runner(capture_after: int) -> tuple[GraphRunner, StubRunner, list]:
    runner = StubRunner()
    graphs = GraphRunner(runner, [1, 2, 4], capture_after)
    captures = []

    def capture(shape, path, warm_up=True):
        captures.append((shape.batch, runner.fast_layers, path))
        return SimpleNamespace(replay=lambda: ("replay", shape.batch, path))

    graphs._capture = capture
    return graphs, runner, captures


def test_a_new_key_runs_eagerly_until_its_nth_use_then_replays():
    graphs, runner, captures = graph_runner(capture_after=3)
    meta = SimpleNamespace(path=0)
    assert graphs.run(StepShape(4, 4), meta) == ("eager", 4)
    assert graphs.run(StepShape(4, 4), meta) == ("eager", 4)
    assert captures == []
    assert graphs.run(StepShape(4, 4), meta) == ("replay", 4, 0)  # third use: captured and replayed
    assert graphs.run(StepShape(4, 4), meta) == ("replay", 4, 0)
    assert captures == [(4, frozenset(), 0)]
    assert len(runner.forwards) == 2


def test_uses_are_counted_per_mix_size_and_path():
    graphs, runner, captures = graph_runner(capture_after=2)
    graphs.run(StepShape(2, 2), SimpleNamespace(path=0))
    runner.fast_layers = frozenset({0, 1})  # a new per-layer mix starts its own count
    graphs.run(StepShape(2, 2), SimpleNamespace(path=0))
    graphs.run(StepShape(2, 2), SimpleNamespace(path=1))
    assert captures == []
    graphs.run(StepShape(2, 2), SimpleNamespace(path=0))
    assert captures == [(2, frozenset({0, 1}), 0)]
    runner.fast_layers = frozenset()
    graphs.run(StepShape(2, 2), SimpleNamespace(path=0))
    assert captures[-1] == (2, frozenset(), 0)


def test_keys_captured_before_serving_replay_at_first_use():
    graphs, runner, captures = graph_runner(capture_after=8)
    for size in graphs.sizes:  # the warm-up captures through get(), not through the gate
        graphs.get(StepShape(size, size), 0)
    assert graphs.run(StepShape(1, 1), SimpleNamespace(path=0)) == ("replay", 1, 0)
    assert runner.forwards == [] and len(captures) == 3


def test_capture_after_one_is_capture_at_first_use():
    graphs, runner, captures = graph_runner(capture_after=1)
    assert graphs.run(StepShape(1, 1), SimpleNamespace(path=2)) == ("replay", 1, 2)
    assert runner.forwards == [] and captures == [(1, frozenset(), 2)]


def test_capture_after_must_be_positive():
    with pytest.raises(ConfigError, match="graph_capture_after"):
        EngineConfig(model="x", graph_capture_after=0)


def test_mixed_steps_pad_to_token_and_sequence_buckets_only_when_enabled():
    graphs, _, captures = graph_runner(capture_after=1)
    assert graphs.step_shape(700, 3, is_decode=False) is None  # mixed graphs off: eager
    assert graphs.step_shape(3, 3, is_decode=True) == StepShape(4, 4)
    assert graphs.step_shape(5, 5, is_decode=True) is None  # beyond the largest decode graph
    graphs.mixed_buckets = (mixed_token_buckets(2112), mixed_seq_buckets(64))
    assert mixed_token_buckets(2112) == [256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2112]
    assert mixed_seq_buckets(64) == [16, 32, 64]
    shape = graphs.step_shape(700, 3, is_decode=False)
    assert shape == StepShape(768, 16, mixed=True) and shape.max_query_len == 768
    assert graphs.step_shape(2113, 3, is_decode=False) is None and graphs.step_shape(8, 65, is_decode=False) is None
    assert graphs.run(shape, SimpleNamespace(path=0)) == ("replay", 16, 0)
    # a decode graph of 4 is another key
    assert graphs.run(StepShape(4, 4), SimpleNamespace(path=0)) == ("replay", 4, 0)
    assert len(captures) == 2


@pytest.mark.parametrize("max_num_seqs", [1, 7, 48, 100, 256])
def test_the_simulator_pads_decode_steps_as_the_engine_does(max_num_seqs):
    """``control.step_model.padded_batch`` mirrors ``graph_batch_sizes`` (the control package cannot import torch)."""
    graphs = GraphRunner(StubRunner(), graph_batch_sizes(max_num_seqs))
    for n in range(1, max_num_seqs + 1):
        assert padded_batch(n, max_num_seqs) == graphs.step_shape(n, n, is_decode=True).batch


@pytest.mark.parametrize("budget", [300, 2048, 2112, 8192, 16384])
def test_mixed_token_buckets_pad_by_at_most_255_tokens_or_a_quarter(budget):
    buckets = mixed_token_buckets(budget)
    assert buckets == sorted(set(buckets)) and buckets[-1] == budget and buckets[0] == min(256, budget)
    for tokens in range(1, budget + 1, 37):
        padded = next(b for b in buckets if b >= tokens)
        assert padded - tokens <= max(255, tokens // 4), (tokens, padded)


class RecordingBuffers:
    def __init__(self):
        self.resets = []

    def reset_for_capture(self, num_tokens, num_seqs):
        self.resets.append((num_tokens, num_seqs))


def test_warm_up_captures_every_mixed_bucket_on_the_native_path_largest_first():
    graphs, runner, captures = graph_runner(capture_after=8)
    runner.buffers = RecordingBuffers()
    graphs.mixed_buckets = ([256, 512, 600], [16, 32])
    graphs.capture_common(paths=(0, 3))
    mixed = [(600, 32), (600, 16), (512, 32), (512, 16), (256, 32), (256, 16)]
    decode = [(4, 4), (4, 4), (2, 2), (2, 2), (1, 1), (1, 1)]
    assert runner.buffers.resets == mixed + decode
    assert [c[2] for c in captures] == [0] * 6 + [0, 3] * 3  # mixed graphs on the native path only
    shape = graphs.step_shape(300, 20, is_decode=False)
    assert graphs.run(shape, SimpleNamespace(path=0)) == ("replay", 32, 0) and runner.forwards == []

