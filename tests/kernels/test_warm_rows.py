"""kernels.warm_rows: the row counts an engine warms cover every GEMM variant of every row count up to the budget."""

from functools import partial

import pytest

from elastiserve.kernels import configs
from elastiserve.kernels.warm_rows import launch_key, rows_to_warm, specialization

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
