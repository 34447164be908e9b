"""What an engine runs once before it serves, so that no request pays for a kernel compile.

Triton compiles a kernel variant the first time a GEMM row bucket, a precision mode or an attention path (with its
tile height) meets it, and a CUDA graph is captured the first time its batch size, mode and path do. Met mid-run,
either is a stall in somebody's latency: in a reduced dense run on the H200 the first step that read BASE pairs took
3.6 s and a later one 3.1 s (benchmarks/serving/results/dense-tiny-run1, elastickv timeline, steps 90-91 and
137-138). ``warm_up_shapes`` lists the eager forwards that cover the compile side for a policy: per GEMM row bucket
up to the chunked-prefill budget, one sequence at the bucket's top and one a row short of it, and per attention path
the query lengths that select each tile height, in every mode the policy reaches. They write no KV (every slot is
-1) and read block 0 only.

Why a row short: Triton specializes an integer argument on whether it is 1 and whether it divides by 16, so a row
count of 100 compiles another variant than 96 or 64 of the same tile. With only the buckets' tops (all multiples of
16) warmed, the first prefill of another length compiled mid-run. The H200 MoE runs (session 6, 4 req/s) showed
0.6 s and 1.0 s steps at 4 and 9 running sequences, with every layer in nested full mode, in both dps and combined
and never in static-fp16, whose dense linears are cuBLAS: the nested GEMM (with its PTX decode) is the kernel that
takes M. Likely cause; not profiled.

The model-level shapes warm the M buckets' tops only; between them the fp8 table's rows (32, 128, 512) and the
split-K (per row tile) choose other GEMM variants, so the runner also runs each kind of linear, and of MoE block,
alone at every row count where ``kernels.warm_rows`` finds a new one (``engine.row_warmup``). Without it the first
nested engine of a process compiled 17 variants inside its ShareGPT loop on the H200 (session 25, 21 s of a 63 s
loop).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastiserve.control.config import preset
from elastiserve.control.precision import group_prefixes
from elastiserve.engine.config import EngineConfig
from elastiserve.kernels.attention_plan import GENERAL, NATIVE, STRUCTURED_READ_PATH
from elastiserve.kernels.configs import M_BUCKETS

ATTENTION_TILE_ROWS = (16, 32, 64)  # the BLOCK_M values attention.choose_block_m picks from


@dataclass(frozen=True, slots=True)
class WarmUpShape:
    fast_layers: frozenset[int]
    path: int
    query_len: int  # one sequence of this many new tokens (and as many KV tokens)


def mode_sets(config: EngineConfig, num_layers: int) -> list[frozenset[int]]:
    """The fast-layer sets a policy runs without per-layer mixes: all-full, all-fast, or both."""
    all_fast = frozenset(range(num_layers))
    if config.policy == "static-fp8":
        return [all_fast]
    if config.uses_nested_weights:
        return [frozenset(), all_fast]
    return [frozenset()]


def graph_mode_sets(config: EngineConfig, num_layers: int) -> list[frozenset[int]]:
    """The fast-layer sets whose graphs are captured before serving: ``mode_sets``, and under per-layer granularity
    every prefix of whole layer groups (``control.precision.group_prefixes``), the mixes in-order eviction and
    restore meet. Kernels compile per mode, not per mix, so ``warm_up_shapes`` keeps to ``mode_sets``."""
    sets = mode_sets(config, num_layers)
    if len(sets) < 2:
        return sets
    return group_prefixes(num_layers, preset(config.policy).precision)


def attention_paths(config: EngineConfig) -> tuple[int, ...]:
    return (NATIVE, STRUCTURED_READ_PATH, GENERAL) if config.uses_kv_demotion else (NATIVE,)


def warm_up_shapes(config: EngineConfig, num_layers: int, group_size: int, max_len: int) -> list[WarmUpShape]:
    """``max_len``: the longest sequence the block tables hold (the budget is clipped to it)."""
    budget = min(config.max_num_batched_tokens, max_len)
    tops = {min(bucket, budget) for bucket in M_BUCKETS if bucket > 1}
    gemm_rows = sorted(tops | {rows - 1 for rows in tops if rows - 1 > 1})  # see the module docstring
    shapes: list[WarmUpShape] = []
    for fast in mode_sets(config, num_layers):
        shapes += [WarmUpShape(fast, NATIVE, rows) for rows in gemm_rows]
        for path in attention_paths(config):
            for tile_rows in ATTENTION_TILE_ROWS:
                query_len = min(budget, max(1, tile_rows // group_size))
                shapes.append(WarmUpShape(fast, path, query_len))
            if path != NATIVE:
                # A query over two row tiles: the prefill variant (no flash-decoding splits, and path 3 runs as
                # path 1). Without it the first prefill next to BASE pairs compiled mid-run: a 2.2 s step in the
                # quarter-scale dense elastickv run on the H200 (benchmarks/serving/results/dense-small-run3).
                shapes.append(WarmUpShape(fast, path, min(budget, max(ATTENTION_TILE_ROWS) // group_size + 1)))
    return list(dict.fromkeys(shapes))  # in order, each once
