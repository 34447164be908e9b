"""``Transitions.restore_between_steps``: a layer whose residual lands over several steps' commits is one
``restore_done``, at the commit that leaves it with no stale chunk (the restore latency ends there)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastiserve.control.events import EventLog
from elastiserve.engine.transitions import Transitions

pytestmark = [pytest.mark.cpu]


class CommitsOverSteps:
    """A runner whose ``between_steps`` returns scripted commits, each followed by the layers still stale."""

    def __init__(self, steps: list[tuple[list[int], frozenset[int]]]) -> None:
        self.steps = iter(steps)
        self.state = SimpleNamespace(fast_layers=frozenset({0, 1}))
        self.pool = SimpleNamespace(block_pool=SimpleNamespace(state=self.state))

    def between_steps(self, restore_layers):
        layers, stale_after = next(self.steps)
        self.state.fast_layers = stale_after
        committed = tuple(SimpleNamespace(chunk=SimpleNamespace(layer=layer)) for layer in layers)
        return SimpleNamespace(deferred=False, committed=committed)


def test_a_layer_restored_over_several_commits_is_done_once():
    runner = CommitsOverSteps([
        ([1, 1], frozenset({0, 1})),  # half of layer 1
        ([1, 0], frozenset({0})),  # the rest of layer 1, the first chunk of layer 0
        ([], frozenset({0})),  # nothing landed
        ([0, 0], frozenset()),  # the rest of layer 0
    ])
    events = EventLog()
    transitions = Transitions(None, None, None, runner, events, None, None, {}, num_layers=2)
    events.add(0.0, 0, "restore_start", 1)
    for step in range(1, 5):
        transitions.restore_between_steps(step)
    done = [e for e in events.events if e.kind == "restore_done"]
    assert [(e.step, e.amount) for e in done] == [(2, 1), (4, 1)]
    assert events.amounts()["restore_done"] == 2  # two layers, not the four commits that carried their chunks
    assert len(events.restore_latencies()) == 1  # the start pairs with the first whole layer, not a partial commit
