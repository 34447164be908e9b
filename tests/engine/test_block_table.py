"""``BlockTable`` keeps its int32 row equal to the list through every in-place list operation (the step inputs copy
only the entries changed since the last step, so a missed change would hand the device a stale block)."""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from list_ops import apply_list_op, list_operations

from elastiserve.engine.block_table import BlockTable
from elastiserve.engine.step_inputs import block_table_array

pytestmark = [pytest.mark.cpu]

blocks = st.integers(0, 10_000)
operations = list_operations(blocks, st.tuples(st.just("sort")), st.tuples(st.just("row")))


@settings(max_examples=300, deadline=None)
@given(st.lists(operations, max_size=40))
def test_row_follows_every_list_operation(ops):
    table, plain = BlockTable([3, 1, 4]), [3, 1, 4]
    for op in ops:
        apply_list_op(table, op)
        apply_list_op(plain, op)
        if op[0] == "row":  # reads in between: only the entries changed since are copied next time
            assert table.row().tolist() == plain
    assert list(table) == plain
    row = table.row()
    assert row.dtype == np.int32 and row.tolist() == plain


def test_row_copies_only_changed_entries():
    table = BlockTable(range(100))
    table.row()
    table.append(100)
    first = table.row()  # grown past 100 entries: room to spare now
    table.append(101)
    table[7] = 70
    row = table.row()
    assert row.tolist() == [*range(7), 70, *range(8, 102)]
    assert np.shares_memory(first, row)  # the same buffer: no reallocation below its capacity
    assert first[7] == 70  # an earlier view sees the change: step inputs read their rows within the step


def test_copies_and_pickles_do_not_share_the_row():
    table = BlockTable([5, 6, 7])
    table.row()
    twin = copy.copy(table)
    twin[0] = 9
    assert table.row().tolist() == [5, 6, 7] and twin.row().tolist() == [9, 6, 7]
    again = pickle.loads(pickle.dumps(table))
    assert isinstance(again, BlockTable) and again.row().tolist() == [5, 6, 7]


def test_block_table_array_pads_rows_of_either_kind():
    rows = [BlockTable([1, 2, 3]).row(), [4], [], np.array([5, 6], dtype=np.int32)]
    table = block_table_array(rows, 5, 4)
    assert table.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0], [0] * 4, [5, 6, 0, 0], [0] * 4]
