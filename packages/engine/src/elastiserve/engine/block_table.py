"""``BlockTable``: a sequence's logical -> physical block list that keeps an int32 copy of itself up to date.

Each step hands the device every running sequence's block table. Converting the Python lists cost ~35 ns an entry:
0.8 ms of a 2.3 ms host step at batch 64 with 4,096-token contexts on the CI CPU (bench_host_overhead.py). Entries
change rarely (a new block every 16 tokens, a pair's blocks on demotion or promotion), so the list remembers the
lowest index changed since its row was last read and ``row()`` copies only from there.

Every in-place list operation goes through this class, so no caller has to remember to mark anything: appends and
extends only add entries past the copied ones, assignments mark their index, and the rare rest (deletion, insertion,
sorting, clearing) mark the whole row.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import SupportsIndex

import numpy as np

__all__ = ["BlockTable"]


class BlockTable(list):
    __slots__ = ("_row", "_synced")

    def __init__(self, blocks: Iterable[int] = ()) -> None:
        super().__init__(blocks)
        self._row = np.zeros(0, dtype=np.int32)
        self._synced = 0  # entries [0, _synced) of _row equal the list's

    def row(self) -> np.ndarray:
        """The entries as an int32 array (a view of a buffer this table reuses: read it before the table changes)."""
        n = len(self)
        if n > self._row.shape[0]:
            grown = np.zeros(max(n, 2 * self._row.shape[0], 16), dtype=np.int32)
            grown[: self._synced] = self._row[: self._synced]
            self._row = grown
        if self._synced < n:
            self._row[self._synced : n] = self[self._synced : n]
            self._synced = n
        return self._row[:n]

    def _changed_from(self, index: int) -> None:
        self._synced = min(self._synced, index)

    def __setitem__(self, key, value) -> None:
        if isinstance(key, slice):
            start, _, step = key.indices(len(self))
            self._changed_from(0 if step != 1 else start)  # a slice assignment may also resize the list
        else:
            index = key.__index__()
            self._changed_from(index if index >= 0 else index + len(self))
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._changed_from(0)
        super().__delitem__(key)

    def __imul__(self, count: SupportsIndex):
        self._changed_from(0)
        return super().__imul__(count)

    def clear(self) -> None:
        self._changed_from(0)
        super().clear()

    def pop(self, index: SupportsIndex = -1) -> int:
        self._changed_from(0)
        return super().pop(index)

    def insert(self, index: SupportsIndex, value: int) -> None:
        self._changed_from(0)
        super().insert(index, value)

    def remove(self, value: int) -> None:
        self._changed_from(0)
        super().remove(value)

    def reverse(self) -> None:
        self._changed_from(0)
        super().reverse()

    def sort(self, *args, **kwargs) -> None:
        self._changed_from(0)
        super().sort(*args, **kwargs)

    def __reduce__(self):
        """Copies and pickles start from the entries alone (a copy must not share this table's row buffer)."""
        return BlockTable, (list(self),)
