"""``BlockTable`` keeps its int32 row equal to the list through every in-place list operation (the step inputs copy
only the entries changed since the last step, so a missed change would hand the device a stale block)."""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastiserve.engine.block_table import BlockTable
from elastiserve.engine.step_inputs import block_table_array

pytestmark = [pytest.mark.cpu]

blocks = st.integers(0, 10_000)
operations = st.one_of(
    st.tuples(st.just("append"), blocks),
    st.tuples(st.just("extend"), st.lists(blocks, max_size=40)),
    st.tuples(st.just("iadd"), st.lists(blocks, max_size=5)),
    st.tuples(st.just("set"), st.integers(-50, 50), blocks),
    st.tuples(st.just("set_slice"), st.integers(-5, 30), st.integers(-5, 30), st.lists(blocks, max_size=6)),
    st.tuples(st.just("set_stride"), blocks),
    st.tuples(st.just("del"), st.integers(-50, 50)),
    st.tuples(st.just("del_slice"), st.integers(0, 30), st.integers(0, 30)),
    st.tuples(st.just("pop"), st.integers(-50, 50)),
    st.tuples(st.just("insert"), st.integers(-50, 50), blocks),
    st.tuples(st.just("remove"), blocks),
    st.tuples(st.just("clear")),
    st.tuples(st.just("reverse")),
    st.tuples(st.just("sort")),
    st.tuples(st.just("imul"), st.integers(0, 2)),
    st.tuples(st.just("row")),
)


def apply(table: list, op: tuple) -> None:
    kind, *args = op
    if kind == "append":
        table.append(args[0])
    elif kind == "extend":
        table.extend(args[0])
    elif kind == "iadd":
        table += args[0]
    elif kind == "set" and table:
        table[args[0] % len(table) - (len(table) if args[0] < 0 else 0)] = args[1]
    elif kind == "set_slice":
        table[args[0] : args[1]] = args[2]
    elif kind == "set_stride" and len(table) >= 2:
        table[::2] = [args[0]] * len(table[::2])
    elif kind == "del" and table:
        del table[args[0] % len(table)]
    elif kind == "del_slice":
        del table[args[0] : args[1]]
    elif kind == "pop" and table:
        table.pop(args[0] % len(table))
    elif kind == "insert":
        table.insert(args[0], args[1])
    elif kind == "remove" and args[0] in table:
        table.remove(args[0])
    elif kind == "clear":
        table.clear()
    elif kind == "reverse":
        table.reverse()
    elif kind == "sort":
        table.sort()
    elif kind == "imul":
        table *= args[0]


@settings(max_examples=300, deadline=None)
@given(st.lists(operations, max_size=40))
def test_row_follows_every_list_operation(ops):
    table, plain = BlockTable([3, 1, 4]), [3, 1, 4]
    for op in ops:
        apply(table, op)
        apply(plain, op)
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
