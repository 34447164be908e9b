"""Host-side cost of the per-step control path (pytest-benchmark): it runs on every scheduling step, so it must stay
far below a decode step (about 10-20 ms for an 8B model on the H200)."""

import pytest

from elastiserve.control import Arbiter, StepObservation, capacity_guard, preset
from elastiserve.memory.sum_state import SumState

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def test_sum_state_alloc_free_16_blocks(benchmark):
    state = SumState([list(range(u * 4, u * 4 + 4)) for u in range(4096)])

    def cycle():
        result = state.alloc_blocks(16)
        state.free_blocks(result.blocks)

    benchmark(cycle)
    state.check_invariants()


def test_arbiter_decision_under_pressure(benchmark):
    config = preset("combined")
    arbiter = Arbiter(config, capacity_guard(256, 8192, 16))
    # A shortage of 36 blocks with eligible pairs and reclaimable residual units: every mechanism is on the table.
    obs = StepObservation(step=100, now=12.5, free_blocks=4, total_blocks=4096, native_blocks=4096, demand_blocks=40,
                          required_blocks=40, backed_units=64, residual_layers=32, units_per_layer=2, free_units=0,
                          target_pairs_eligible=500, running=64, waiting=8)
    decision = benchmark(arbiter.decide_pressure, obs)
    freed = decision.demote_pairs + decision.preempt + len(decision.evict_residual_layers or ())
    assert freed > 0, decision
