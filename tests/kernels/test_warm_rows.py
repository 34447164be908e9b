"""kernels.warm_rows: the row counts an engine warms cover every GEMM variant of every row count up to the budget."""

from functools import partial

import pytest

from elastiserve.kernels import configs
from elastiserve.kernels.fp8_activations import quantizes_in_one_pass
from elastiserve.kernels.warm_rows import grouped_launch_key, launch_key, rows_to_warm, specialization

pytestmark = [pytest.mark.cpu]

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


def test_every_row_count_has_a_warmed_row_with_its_variants():
    key = partial(launch_key, arch="sm90", num_sms=132)
    rows = rows_to_warm(LLAMA_8B, 2048, key=key)
    warmed = {(tuple(key(m, n, k) for n, k in LLAMA_8B), specialization(m)) for m in rows}
    for m in range(1, 2049):
        assert (tuple(key(m, n, k) for n, k in LLAMA_8B), specialization(m)) in warmed, m
    assert len(rows) < 2048 // 4  # ranges, not every row count


def test_the_rows_session_25_compiled_mid_run_are_warmed():
    # The fp8 table's rows change at 32 / 128 / 512 (not M bucket tops): those ranges' tops and a row short of them.
    rows = rows_to_warm(LLAMA_8B, 2048, key=partial(launch_key, arch="sm90", num_sms=132))
    tops = [top for top, *_ in configs._FP8_SM90_ROWS]
    assert {32, 128, 512} <= set(tops)
    for top in tops:
        assert top in rows and top - 1 in rows
    assert {1, 2, 2048} <= set(rows)


def test_a_key_that_never_changes_warms_one_row_per_specialization():
    rows = rows_to_warm([(8, 8)], 100, key=lambda m, n, k: ())
    assert rows == [1, 96, 100]  # 1; the largest multiple of 16; the largest other
    assert rows_to_warm([(8, 8)], 1, key=lambda m, n, k: ()) == [1]


QWEN3_30B_A3B_EXPERTS = [(1536, 2048, 128, 8, True), (2048, 768, 128, 8, False)]  # gate_up, down: N, K, E, top-k


def test_every_token_count_has_a_warmed_count_with_its_grouped_variants():
    key = partial(grouped_launch_key, arch="sm90", num_sms=132)
    tokens = rows_to_warm(QWEN3_30B_A3B_EXPERTS, 8192, key=key)
    warmed = {tuple(key(t, *shape) for shape in QWEN3_30B_A3B_EXPERTS) for t in tokens}
    for t in range(1, 8193):
        assert tuple(key(t, *shape) for shape in QWEN3_30B_A3B_EXPERTS) in warmed, t
    assert len(tokens) < 100


def test_each_grouped_tile_change_has_the_previous_tiles_last_count_warmed():
    # Each sm90 prefill tile of the grouped table first meets some token count; the count before it (the previous
    # tile's last) is warmed, as is a count in the new tile's range (the exhaustive test above).
    key = partial(grouped_launch_key, arch="sm90", num_sms=132)
    tokens = rows_to_warm(QWEN3_30B_A3B_EXPERTS, 8192, key=key)
    down = QWEN3_30B_A3B_EXPERTS[1]
    full_tiles = [key(t, *down)[0][configs.GROUPED_MODES.index("full")] for t in range(1, 8193)]
    firsts = {full_tiles.index(tile) + 1 for tile in configs._GROUPED_PREFILL_SM90["full"].values()}
    assert firsts == {272, 4112}  # 17 and 257 rows per expert: the 64 and 1,024 buckets' first (equal tiles merge)
    assert all(first - 1 in tokens for first in firsts)


def test_grouped_key_counts_rows_per_expert_and_the_quantized_rows():
    key = partial(grouped_launch_key, arch="sm90", num_sms=132)
    gate_up, down = QWEN3_30B_A3B_EXPERTS
    # One token routes 8 rows: under one row per expert, counted as one.
    assert key(1, *gate_up)[0] == tuple(configs.choose_grouped_config("sm90", mode, 1, 1536, 2048, 132)
                                        for mode in configs.GROUPED_MODES)
    assert key(1024, *down)[0] == tuple(configs.choose_grouped_config("sm90", mode, 64, 2048, 768, 132)
                                        for mode in configs.GROUPED_MODES)
    t = 300  # the first GEMM quantizes 300 tokens of 2,048; the second 2,400 rows of 768
    assert key(t, *gate_up)[2] == quantizes_in_one_pass(300, 2048)
    assert key(t, *down)[2] == quantizes_in_one_pass(2400, 768)
