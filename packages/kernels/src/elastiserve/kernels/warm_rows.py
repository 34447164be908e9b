"""The row counts at which a model's linears compile every GEMM variant they can meet, so that an engine compiles
them before it serves rather than inside somebody's step.

Which variant a linear launches is a pure function of its row count M, its [N, K] and the platform: the route
(skinny GEMV kernel, tiled GEMM, materialized full mode, fp8 or weight-only fast mode), the tile table's row for M,
and the occupancy split-K, which counts M's row tiles; Triton then specializes the M argument on whether it is 1 and
whether 16 divides it. ``launch_key`` is that function's whole output for one shape, and ``rows_to_warm`` scans
1..max_rows for the ranges of equal keys and keeps, per range, the largest row count of each specialization class.
``grouped_launch_key`` is the same for one expert tensor of a MoE block at a step's token count: the grouped
kernel's tile follows the rows per expert (tokens x top-k / experts), its fast mode and the quantizer before it the
rows it quantizes (the tokens before the first GEMM's gather, every routed row before the second).

Why it exists: an engine that warmed only the M buckets' tops compiled 17 variants inside the first nested
engine's throughput loop on the H200 (session 25, ShareGPT, static-fp8: 28 steps over 10x the median, 21 s of a
63 s loop): the fp8 table's rows change at 32, 128 and 512, which are not bucket tops, and the split-K changes with
every row tile below the SM count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from elastiserve.kernels import configs, skinny_configs
from elastiserve.kernels.fp8_activations import quantizes_in_one_pass
from elastiserve.kernels.nested_gemm import fast_mode_for
from elastiserve.platforms import current_platform

Shape = tuple[int, ...]  # the arguments after the row count that a key function takes: (n, k) for launch_key


def launch_key(m: int, n: int, k: int, arch: str | None = None, num_sms: int | None = None) -> tuple:
    """Everything the GEMM dispatch picks from ``m`` rows for an [N, K] weight: the tables of ``arch`` with
    ``num_sms`` (defaults: this platform's), the fast-mode route always this platform's (``fast_mode_for``)."""
    platform = current_platform()
    arch = platform.arch if arch is None else arch
    num_sms = platform.num_sms if num_sms is None else num_sms
    return (
        tuple(configs.choose_config(arch, mode, m, n, k, num_sms) for mode in configs.MODES),
        tuple(skinny_configs.choose_skinny(arch, mode, m, n, k, num_sms) for mode in skinny_configs.SKINNY_MODES),
        configs.materializes_full(arch, m, n, k),
        fast_mode_for(m), fast_mode_for(m, quantized_input=True, k=k),
        quantizes_in_one_pass(m, k),  # the quantizer before an fp8 GEMM on fp16 rows: one pass or a loop
        m if m <= skinny_configs.SKINNY_MAX_ROWS else 0,  # the skinny kernel pads M to a power of two (a constexpr)
    )


def grouped_launch_key(tokens: int, n: int, k: int, num_experts: int, top_k: int, gathers: bool,
                       arch: str | None = None, num_sms: int | None = None) -> tuple:
    """What the grouped MoE GEMM over an [E, N, K] expert tensor picks from a step of ``tokens`` tokens routed to
    ``top_k`` experts each (``gathers``: the block's first GEMM, which quantizes the tokens before gathering them
    into expert order; the second quantizes all tokens x top-k rows). Its integer arguments (N, K; the tile map's
    length is not specialized) do not change with the rows, so there is no specialization class to add."""
    platform = current_platform()
    arch = platform.arch if arch is None else arch
    num_sms = platform.num_sms if num_sms is None else num_sms
    rows = tokens * top_k
    per_expert = max(1, rows // num_experts)  # as nested_moe._grouped_config counts them
    return (
        tuple(configs.choose_grouped_config(arch, mode, per_expert, n, k, num_sms) for mode in configs.GROUPED_MODES),
        fast_mode_for(rows, grouped=True),
        quantizes_in_one_pass(tokens if gathers else rows, k),
    )


def specialization(m: int) -> tuple[bool, bool]:
    """How Triton specializes an integer argument: equal to 1, divisible by 16, or neither."""
    return m == 1, m % 16 == 0


def rows_to_warm(shapes: Iterable[Shape], max_rows: int, key: Callable[..., tuple] = launch_key) -> list[int]:
    """Row counts in 1..max_rows whose launches over every shape of ``shapes`` (``key(m, *shape)``) compile each
    variant any row count up to ``max_rows`` would: per range of equal keys (over all shapes), the largest row of
    each specialization."""
    shapes = sorted(set(shapes))
    rows: set[int] = set()
    current: tuple | None = None
    chosen: dict[tuple[bool, bool], int] = {}
    for m in range(1, max_rows + 1):
        this = tuple(key(m, *shape) for shape in shapes)
        if this != current:
            rows.update(chosen.values())
            current, chosen = this, {}
        chosen[specialization(m)] = m
    rows.update(chosen.values())
    return sorted(rows)
