"""What an engine prepares before serving: the pair kernels run once (block 0 onto itself, bit-exact); the step
shapes it compiles (every mode, path, attention tile height and GEMM row bucket; their forwards write no KV); which
decode graphs it captures, per policy: the native path in full mode always; the structured and general paths too
when KV demotion is on; the all-fast mode too with nested weights (static-fp8 only that one), and per layer
(combined) each prefix of whole layer groups. The CPU has no CUDA graphs, so a recorder stands in for the graph
runner; the GPU e2e tests replay the real ones."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_fp16_model, small_llama_config, small_moe_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.cpu]

LAYERS = 3


class RecordingGraphs:
    def __init__(self, runner):
        self.runner, self.captured = runner, []

    def capture_common(self, paths, warm_up=True):
        self.captured.append((self.runner.fast_layers, paths, warm_up))


def engine_for(policy: str) -> LLMEngine:
    model = random_fp16_model(small_llama_config(LAYERS, 128))
    options = dict(model="tiny", device="cpu", policy=policy, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                   kv_cache_budget=64 * 3 * 2 * 2 * 4 * 16 * 2)
    return LLMEngine(EngineConfig(**options), model=model, eos_token_ids=())


@pytest.mark.parametrize("policy, expected", [
    ("static-fp16", [(frozenset(), (0,), True)]),
    ("elastickv", [(frozenset(), (0, 3, 2), True)]),
    ("dps", [(frozenset(), (0,), True), (frozenset(range(LAYERS)), (0,), True)]),
    # 3 layers in combined's 4 layer groups: a group per layer, so every prefix. The whole-model modes go first,
    # each capture after a warm-up forward; the prefixes between them reuse those kernels and skip it.
    ("combined", [(frozenset(), (0, 3, 2), True), (frozenset(range(LAYERS)), (0, 3, 2), True)]
                 + [(frozenset(range(n)), (0, 3, 2), False) for n in range(1, LAYERS)]),
    ("static-fp8", [(frozenset(range(LAYERS)), (0,), True)]),
])  # fmt: skip
def test_capture_plan_per_policy(policy, expected):
    engine = engine_for(policy)
    try:
        runner = engine.runner
        before = runner.fast_layers
        runner.graphs = RecordingGraphs(runner)
        runner.capture_graphs()
        assert runner.graphs.captured == expected
        assert runner.fast_layers == before  # the mode the engine was in is put back
    finally:
        engine.close()


def test_warm_up_runs_the_pair_kernels_and_leaves_block_zero_bit_exact():
    engine = engine_for("elastickv")
    try:
        runner = engine.runner
        values = torch.randn(runner.kv_cache[0].shape, generator=torch.Generator().manual_seed(3)) * 100
        runner.kv_cache[0].copy_(values.half())
        before = runner.kv_cache[0].view(torch.int16).clone()
        calls = []
        ops = runner.ops

        class CountingOps:
            def __getattr__(self, name):
                fn = getattr(ops, name)
                return lambda *args: (calls.append(name), fn(*args))[1]

        runner.ops = CountingOps()
        runner.warm_up()
        assert calls == ["kv_demote", "kv_promote"]
        assert torch.equal(runner.kv_cache[0].view(torch.int16), before)
    finally:
        engine.close()


def test_a_deferred_restore_request_is_kept_for_the_next_step():
    """Under tensor parallelism a step whose peers are still copying commits and starts nothing
    (``StepReport.deferred``); the engine must ask again next step instead of dropping the request."""
    from elastiserve.memory.sum_manager import StepReport

    engine = engine_for("dps")
    try:
        asked = []
        replies = [StepReport((), (), 0, deferred=True), StepReport((), (), 0), StepReport((), (), 0)]

        def between_steps(restore_layers):
            asked.append(restore_layers)
            return replies.pop(0)

        engine.runner.between_steps = between_steps
        engine.transitions.restore_layers = (0, 1)
        engine.transitions.restore_between_steps(1)
        engine.transitions.restore_between_steps(2)
        engine.transitions.restore_between_steps(3)
        assert asked == [(0, 1), (0, 1), None]
    finally:
        engine.runner.__dict__.pop("between_steps", None)
        engine.close()


@pytest.mark.parametrize("policy, modes, paths", [
    ("static-fp16", 1, 1), ("elastickv", 1, 3), ("dps", 2, 1), ("combined", 2, 3), ("static-fp8", 1, 1),
])  # fmt: skip
def test_warm_up_shapes_cover_each_mode_path_and_bucket(policy, modes, paths):
    from elastiserve.engine.warmup import warm_up_shapes

    config = EngineConfig(model="tiny", device="cpu", policy=policy, max_num_batched_tokens=512, max_num_seqs=8)
    shapes = warm_up_shapes(config, LAYERS, group_size=4, max_len=2048)
    assert len({s.fast_layers for s in shapes}) == modes and len({s.path for s in shapes}) == paths
    native = sorted({s.query_len for s in shapes if s.path == 0})
    # Tile heights 16/32/64 at group 4; GEMM buckets up to the budget, each at its top and a row short of it (Triton
    # compiles a row count that 16 does not divide as another variant).
    assert native == [4, 8, 15, 16, 63, 64, 255, 256, 511, 512]
    assert {s.query_len for s in shapes if s.path != 0} == ({4, 8, 16, 17} if paths > 1 else set())  # 17: two tiles
    assert len(shapes) == len(set(shapes))
    clipped = warm_up_shapes(config, LAYERS, group_size=4, max_len=100)
    assert max(s.query_len for s in clipped) == 100


def test_warm_up_forwards_write_no_kv():
    engine = engine_for("combined")
    try:
        runner = engine.runner
        runner.kv_cache.copy_((torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(5))).half())
        before = runner.kv_cache.view(torch.int16).clone()
        shapes = [s for s in runner.warm_up_shapes() if s.query_len <= 16]  # the interpreter is slow at 64+ rows
        assert {s.path for s in shapes} == {0, 2, 3} and len({s.fast_layers for s in shapes}) == 2
        runner.run_warm_up_shapes(shapes)
        assert torch.equal(runner.kv_cache.view(torch.int16), before)
        assert runner.fast_layers == frozenset()
    finally:
        engine.close()


def test_warm_up_by_rows_runs_each_kind_of_linear_at_the_warm_rows_in_each_mode(monkeypatch):
    from elastiserve.engine import row_warmup

    engine = engine_for("dps")
    try:
        runner = engine.runner
        real_warm_up, calls = row_warmup.warm_up_linears, []
        monkeypatch.setattr(row_warmup, "warm_up_linears",
                            lambda linears, rows, device: calls.append((runner.fast_layers, linears, rows)))
        rows, tokens = runner.warm_up_by_rows()
        assert tokens == []  # a dense model has no MoE block
        assert rows == sorted(rows) and rows[0] == 1 and max(rows) == 16  # up to the step's token budget
        assert [fast for fast, _, _ in calls] == [frozenset(), frozenset(range(LAYERS))]  # dps: both modes
        linears = calls[0][1]
        kinds = {(type(m).__name__, m.out_features, m.in_features) for m in linears}
        assert len(kinds) == len(linears) == 5  # one of each: qkv, o, gate_up, down (nested) and lm_head (plain)
        assert {name for name, _, _ in kinds} == {"NestedLinear", "Linear"}
        assert runner.fast_layers == frozenset()
        runner.set_fast_layers(frozenset(range(LAYERS)))  # the real warm-up on the CPU, fp16 and Fp8Rows inputs
        real_warm_up(linears, [1, 3], runner.device)
        runner.set_fast_layers(frozenset())
    finally:
        engine.close()


@pytest.mark.parametrize("policy, nested", [("dps", True), ("static-fp16", False)])
def test_warm_up_by_rows_runs_one_moe_block_of_each_kind_at_its_token_counts_in_each_mode(monkeypatch, policy,
                                                                                         nested):
    from elastiserve.engine import row_warmup
    from elastiserve.engine.nested_weights import NestedExperts

    model = random_fp16_model(small_moe_config(LAYERS, 128))
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", policy=policy, block_size=4, max_num_seqs=4,
                                    max_num_batched_tokens=16, kv_cache_budget=64 * 3 * 2 * 2 * 4 * 16 * 2),
                       model=model, eos_token_ids=())
    try:
        runner = engine.runner
        real_block_warm_up, calls = row_warmup.warm_up_moe_block, []

        def record(block, counts, device):
            calls.append((runner.fast_layers, block.w_gate_up.fast if nested else None, counts))
            real_block_warm_up(block, counts, device)  # the real blocks on the CPU: router, grouped GEMMs, combine

        monkeypatch.setattr(row_warmup, "warm_up_moe_block", record)
        _, tokens = runner.warm_up_by_rows()
        blocks = row_warmup.distinct_moe_blocks(runner.model)
        assert len(blocks) == 1 < LAYERS  # every layer's block is one kind
        assert isinstance(blocks[0].w_gate_up, NestedExperts) is nested
        assert len(tokens) == 1 and tokens[0][0] == 1 and max(tokens[0]) == 16
        modes = [frozenset(), frozenset(range(LAYERS))] if nested else [frozenset()]
        assert [(fast, counts) for fast, _, counts in calls] == [(mode, tokens[0]) for mode in modes]
        if nested:  # the block ran in its layer's mode: full, then fast
            assert [fast for _, fast, _ in calls] == [False, True]
        assert runner.fast_layers == frozenset()
    finally:
        engine.close()
