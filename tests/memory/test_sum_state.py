"""Algorithm 1 bookkeeping (pure Python): under random alloc / free / evict / restore sequences no block is handed
out twice, every unit sits in exactly one set, fast mode for a layer begins exactly when one of its BACKED units is
taken, full mode returns only after every residual chunk is restored, and a refused allocation changes nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from elastiserve.memory.errors import BlockStateError, ConfigError, PoolExhausted
from elastiserve.memory.sum_state import ResidualChunk, SumState, UnitSet

pytestmark = [pytest.mark.cpu]


def _layout(blocks_per_unit: list[int]) -> list[list[int]]:
    """Consecutive block ids with one dead id after every unit, as straddling blocks leave."""
    lists, next_id = [], 0
    for count in blocks_per_unit:
        lists.append(list(range(next_id, next_id + count)))
        next_id += count + 1
    return lists


def _state(blocks_per_unit=(2, 3, 2, 2, 3, 2, 2, 1), residual_chunks=(2, 1, 2)) -> SumState:
    state = SumState(_layout(list(blocks_per_unit)))
    for layer, chunks in enumerate(residual_chunks):
        state.bind_residual(layer, chunks)
    state.check_invariants()
    return state


def test_alloc_uses_free_units_before_backed_ones_and_then_enters_fast_mode():
    state = _state()
    free_blocks = state.num_free_blocks()
    result = state.alloc_blocks(free_blocks)
    assert result.taken_residuals == () and state.is_full_mode and state.mode_events == []
    assert state.num_free_units() == 0
    with pytest.raises(PoolExhausted):
        state.alloc_blocks(1, allow_backed=False)
    taken = state.alloc_blocks(1)
    assert len(taken.taken_residuals) == 1 and state.fast_layers == {taken.taken_residuals[0].layer}
    assert state.mode_events[-1].kind == "fast" and state.mode_events[-1].fast_layers == state.fast_layers
    state.check_invariants()


def test_pool_exhausted_has_no_side_effects():
    state = _state()
    total = state.num_free_blocks(include_backed=True)
    before = (state.num_free_blocks(), state.units_in(UnitSet.BACKED), state.fast_layers)
    with pytest.raises(PoolExhausted):
        state.alloc_blocks(total + 1)
    with pytest.raises(PoolExhausted):
        state.alloc_blocks(state.num_free_blocks() + 1, allow_backed=False)
    assert (state.num_free_blocks(), state.units_in(UnitSet.BACKED), state.fast_layers) == before
    assert state.mode_events == []
    state.check_invariants()


def test_allow_backed_layers_limits_which_residuals_are_taken():
    state = _state()
    state.alloc_blocks(state.num_free_blocks())
    layer2_blocks = sum(len(state.unit_blocks(u)) for u in state.units_in(UnitSet.BACKED)
                        if state.backed_chunk(u).layer == 2)
    assert not state.can_alloc(layer2_blocks + 1, allow_backed_layers={2})
    result = state.alloc_blocks(layer2_blocks, allow_backed_layers={2})
    assert {c.layer for c in result.taken_residuals} == {2} and state.fast_layers == {2}


def test_evict_layers_frees_units_and_restore_brings_full_mode_back():
    state = _state()
    freed = state.evict_layers([0])
    assert len(freed) == 2 and state.fast_layers == {0}
    assert all(state.set_of(u) is UnitSet.FREE for u in freed)
    assert state.plan_restore(layers={1}) is None  # only layer 0 is stale
    first = state.plan_restore()
    second = state.plan_restore()
    assert state.plan_restore() is None  # both stale chunks are planned
    assert {first.chunk, second.chunk} == {ResidualChunk(0, 0), ResidualChunk(0, 1)}
    assert first.unit == first.previous_unit  # its old unit was still FREE: no remap needed
    state.commit_restore(first)
    assert state.fast_layers == {0}  # one chunk is still out
    state.abort_restore(second)
    assert state.fast_layers == {0} and state.set_of(second.unit) is UnitSet.FREE
    again = state.plan_restore()
    state.commit_restore(again)
    assert state.is_full_mode and state.mode_events[-1].kind == "full"
    with pytest.raises(BlockStateError):
        state.commit_restore(again)
    state.check_invariants()


def test_protocol_errors():
    state = _state()
    blocks = state.alloc_blocks(3).blocks
    with pytest.raises(BlockStateError):
        state.free_blocks([blocks[0], blocks[0]])
    state.free_blocks(blocks)
    with pytest.raises(BlockStateError):
        state.free_blocks(blocks[:1])
    with pytest.raises(ConfigError):
        SumState([[0], []])
    with pytest.raises(ConfigError):
        SumState([[0, 1], [1]])
    with pytest.raises(ConfigError):
        state.bind_residual(0, 1)


class SumStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = _state()
        self.held: list[int] = []
        self.tasks = []
        self.restored_since_fast = set()

    @rule(n=st.integers(1, 9), allow_backed=st.booleans(), layers=st.sampled_from([None, {0}, {1, 2}]))
    def alloc(self, n, allow_backed, layers):
        fast_before, backed_before = self.state.fast_layers, self.state.num_backed_units()
        events_before = len(self.state.mode_events)
        if not self.state.can_alloc(n, allow_backed, layers):
            with pytest.raises(PoolExhausted):
                self.state.alloc_blocks(n, allow_backed=allow_backed, allow_backed_layers=layers)
            assert self.state.num_backed_units() == backed_before and len(self.state.mode_events) == events_before
            return
        result = self.state.alloc_blocks(n, allow_backed=allow_backed, allow_backed_layers=layers)
        assert len(result.blocks) == n and not set(result.blocks) & set(self.held)
        self.held.extend(result.blocks)
        taken_layers = {c.layer for c in result.taken_residuals}
        assert len(result.taken_residuals) == backed_before - self.state.num_backed_units()
        assert allow_backed or not taken_layers
        assert layers is None or taken_layers <= layers
        # fast mode begins exactly when a BACKED unit is taken, and only for the layers it belonged to
        assert self.state.fast_layers == fast_before | taken_layers
        entered = taken_layers - fast_before
        assert (len(self.state.mode_events) > events_before) == bool(entered)

    @rule(data=st.data())
    @precondition(lambda self: self.held)
    def free(self, data):
        count = data.draw(st.integers(1, len(self.held)))
        chosen = data.draw(st.permutations(self.held))[:count]
        self.state.free_blocks(chosen)
        self.held = [b for b in self.held if b not in set(chosen)]

    @rule(layer=st.integers(0, 2))
    def evict(self, layer):
        fast_before = self.state.fast_layers
        freed = self.state.evict_layers([layer])
        assert self.state.fast_layers == (fast_before | {layer} if freed else fast_before)

    @rule()
    def plan(self):
        task = self.state.plan_restore()
        if task is not None:
            assert self.state.set_of(task.unit) is UnitSet.RESTORING
            self.tasks.append(task)

    @rule(data=st.data(), ok=st.booleans())
    @precondition(lambda self: self.tasks)
    def finish(self, data, ok):
        task = self.tasks.pop(data.draw(st.integers(0, len(self.tasks) - 1)))
        outstanding = [t for t in self.tasks if t.chunk.layer == task.chunk.layer]
        stale = [c for c in self.state.stale_chunks() if c.layer == task.chunk.layer]
        if ok:
            self.state.commit_restore(task)
            # full precision for a layer returns only when its last chunk is restored
            assert (task.chunk.layer in self.state.fast_layers) == bool(outstanding or stale)
        else:
            self.state.abort_restore(task)
            assert task.chunk.layer in self.state.fast_layers

    @invariant()
    def consistent(self):
        self.state.check_invariants()
        assert self.state.num_allocated_blocks() == len(self.held) == len(set(self.held))
        assert self.state.is_full_mode == (self.state.num_stale_chunks() == 0)


SumStateMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
test_sum_state_machine = SumStateMachine.TestCase


def test_sum_state_does_not_import_torch():
    code = "import sys, elastiserve.memory.sum_state; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
