"""``PairState`` and ``PairStates``: a sequence's per-pair fidelity list that keeps its own counts.

Every step asks each running sequence how many of its pairs are BASE or PROMOTING (the policy observation twice,
the exposure count, the attention metadata), and ``list.count`` answered each by scanning the whole list: ~8 scans
of every sequence a step, 0.35 ms of elastickv's 0.68 ms of host time outside the forward on the CI CPU (batch 56,
4,096-token contexts, 80 % BASE; cProfile, session 47), where static-fp16 spends 0.20 ms. On an H100 the same runs
spent 2.2 ms a step between steps for elastickv against 0.9 ms for dps (BENCHMARKS.md, session 47). States change
rarely (a pair's demotion, promotion or reset), so the list counts them as they change and the per-step questions
cost O(1).

Every in-place list operation goes through this class: item assignments adjust the counts, appends and extends add
the new entries' states, and the rare rest (slice assignment, deletion, insertion, clearing) count again from
scratch.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import SupportsIndex

__all__ = ["PairState", "PairStates"]


class PairState(enum.Enum):
    TARGET = "target"  # two physical fp16 blocks
    BASE = "base"  # one packed block listed for both logical blocks; low bytes in a host slot
    PROMOTING = "promoting"  # still BASE for readers; two fresh blocks reserved until the unpack event completes


_TARGET, _PROMOTING = PairState.TARGET, PairState.PROMOTING


class PairStates(list):
    __slots__ = ("_not_target", "_promoting")

    def __init__(self, states: Iterable[PairState] = ()) -> None:
        super().__init__(states)
        self._recount()

    @property
    def num_not_target(self) -> int:
        """Pairs readers treat as BASE (BASE or PROMOTING)."""
        return self._not_target

    @property
    def num_base(self) -> int:
        """Pairs in state BASE (a promotion may start on them)."""
        return self._not_target - self._promoting

    def _recount(self) -> None:
        self._not_target = len(self) - super().count(_TARGET)
        self._promoting = super().count(_PROMOTING)

    def _add(self, state: PairState, sign: int) -> None:
        if state is not _TARGET:
            self._not_target += sign
            if state is _PROMOTING:
                self._promoting += sign

    def __setitem__(self, key, value) -> None:
        if isinstance(key, slice):
            super().__setitem__(key, value)
            self._recount()
            return
        old = self[key]
        super().__setitem__(key, value)
        self._add(old, -1)
        self._add(value, 1)

    def append(self, state: PairState) -> None:
        super().append(state)
        self._add(state, 1)

    def extend(self, states: Iterable[PairState]) -> None:
        added = list(states)
        super().extend(added)
        self._not_target += len(added) - added.count(_TARGET)
        self._promoting += added.count(_PROMOTING)

    def __iadd__(self, states: Iterable[PairState]):
        self.extend(states)
        return self

    def clear(self) -> None:
        super().clear()
        self._not_target = self._promoting = 0

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._recount()

    def __imul__(self, count: SupportsIndex):
        result = super().__imul__(count)
        self._recount()
        return result

    def pop(self, index: SupportsIndex = -1) -> PairState:
        state = super().pop(index)
        self._add(state, -1)
        return state

    def insert(self, index: SupportsIndex, state: PairState) -> None:
        super().insert(index, state)
        self._add(state, 1)

    def remove(self, state: PairState) -> None:
        super().remove(state)
        self._add(state, -1)

    def __reduce__(self):
        """Copies and pickles start from the entries alone, and count them again."""
        return PairStates, (list(self),)
