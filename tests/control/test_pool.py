"""Pins the simulator's KV pools: the in-simulator ``UnitPool`` (DPS Algorithm 1 over units) and the adapter over the
real ``elastiserve.memory.sum_state.SumState``: no block lost or handed out twice under random alloc/free/evict/
restore; native units used before residual ones; restore only of layers whose units are FREE."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastiserve.control.pool import PoolError, SumStatePool, UnitPool, make_pool

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def test_allocation_order_and_restore():
    pool = UnitPool(native_units=2, num_layers=2, units_per_layer=2, blocks_per_unit=2)
    assert (pool.total_blocks(), pool.free_block_count(), pool.backed_units()) == (4, 4, 4)
    a = pool.alloc_blocks(4)
    assert sorted(a) == [0, 1, 2, 3]  # native units first
    assert pool.alloc_blocks(1) is None  # residual is BACKED and not allowed
    b = pool.alloc_blocks(1, allow_backed=True)  # reactive DPS path evicts layer 0
    assert pool.evicted_layers() == {0} and b[0] in range(4, 8)
    assert pool.plan_restore() == ()  # layer 0 holds a KV block
    pool.free_blocks(b)
    assert pool.plan_restore() == (0,)
    pool.begin_restore(0)
    assert pool.total_blocks() == 4 and pool.evicted_layers() == {0}  # still fast while copying
    pool.commit_restore(0)
    assert pool.evicted_layers() == frozenset() and pool.free_block_count() == 0
    with pytest.raises(PoolError):
        pool.free_blocks(b)
    pool.check()


@pytest.mark.parametrize("pool_class", [UnitPool, SumStatePool])
@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "evict", "restore", "commit"]), st.integers(0, 9)),
                max_size=80))
def test_no_block_lost_or_handed_out_twice(pool_class, ops):
    pool = pool_class(native_units=3, num_layers=3, units_per_layer=2, blocks_per_unit=3)
    held: list[int] = []
    restoring: list[int] = []
    for op, x in ops:
        if op == "alloc":
            got = pool.alloc_blocks(x, allow_backed=bool(x % 2))
            if got is not None:
                assert len(got) == x and not set(got) & set(held)
                held.extend(got)
        elif op == "free" and held:
            pool.free_blocks(held[: x + 1])
            del held[: x + 1]
        elif op == "evict":
            pool.evict_layers([x % 3])
        elif op == "restore":
            for layer in pool.plan_restore()[:1]:
                pool.begin_restore(layer)
                restoring.append(layer)
        elif op == "commit" and restoring:
            pool.commit_restore(restoring.pop())
        pool.check()
        assert pool.allocated_count() == len(held) == len(set(held))
        assert pool.free_block_count() + len(held) == pool.total_blocks()


def test_sum_state_adapter_restores_into_any_free_unit():
    pool = SumStatePool(native_units=2, num_layers=2, units_per_layer=2, blocks_per_unit=1)
    assert (pool.total_blocks(), pool.backed_units()) == (2, 4)
    held = pool.alloc_blocks(2)
    taken = pool.alloc_blocks(1, allow_backed=True)  # takes a BACKED unit: its layer turns fast
    assert taken is not None and len(pool.evicted_layers()) == 1
    (layer,) = pool.evicted_layers()
    assert pool.plan_restore() == ()  # no FREE unit
    pool.free_blocks(held)  # two native units FREE: the stale chunk can be restored into one of them (remap)
    assert pool.plan_restore() == (layer,)
    pool.begin_restore(layer)
    pool.commit_restore(layer)
    assert pool.evicted_layers() == frozenset()
    pool.check()
    assert isinstance(make_pool("auto", 2, 1, 1), SumStatePool)
    assert isinstance(make_pool("sim", 2, 1, 1), UnitPool)
