"""The physical SUM manager on the device's back-end: the KV view and residual views alias the same units (dual
mapping), restores are bit-exact against the pinned backup (also when remapped onto a different unit), the mode flips
back only between steps, a failed restore keeps the layer in FP8 with consistent state, and restores running in the
worker thread never disturb KV blocks in use while the caller allocates and frees."""

from __future__ import annotations

import random

import pytest
import torch

from elastiserve.memory.errors import ConfigError, VMMError
from elastiserve.memory.residual_backup import ResidualBackup
from elastiserve.memory.sum_manager import (
    SumConfig,
    SumManager,
    choose_unit_bytes,
    dead_block_fraction,
    unit_block_lists,
)
from elastiserve.memory.sum_state import UnitSet

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

MiB = 1 << 20


def test_unit_size_choice_and_block_layout():
    assert choose_unit_bytes(2 * MiB, 2 * MiB) == 2 * MiB  # Llama-3.1-8B, 16-token blocks: no loss
    assert dead_block_fraction(8192, 1536) == 0.125
    assert choose_unit_bytes(1536, 4096, target=8192) == 8192
    # Qwen3-30B-A3B, 16-token blocks: 1.5 MiB. In 2 MiB units every third unit would hold no whole block; 6 MiB
    # units hold four each with none lost.
    assert choose_unit_bytes(3 * MiB // 2, 2 * MiB) == 6 * MiB


@pytest.mark.parametrize("block_bytes", [1536, 3 * MiB // 2, 5 * MiB // 4, 3 * MiB, 2 * MiB - 2, 786432 + 2])
def test_chosen_unit_always_holds_a_whole_block(block_bytes):
    unit = choose_unit_bytes(block_bytes, 2 * MiB)
    lists = unit_block_lists(64, unit, block_bytes)
    assert unit % (2 * MiB) == 0 and all(lists), (unit, [len(x) for x in lists][:8])
    lists = unit_block_lists(6, 4096, 1536)
    alive = sum(map(len, lists))
    assert lists[0] == [0, 1] and lists[1] == [3, 4] and lists[2] == [6, 7]
    assert 1 - alive / (6 * 4096 // 1536) == pytest.approx(dead_block_fraction(4096, 1536))


class FlakyBackend:
    """Delegates to a real back-end; ``fail[name]`` makes the next calls of ``name`` raise like a driver error."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.fail = {"map": 0, "set_access": 0}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def device(self):
        return self.inner.device

    def _maybe_fail(self, name):
        if self.fail[name]:
            self.fail[name] -= 1
            raise VMMError(f"injected {name} failure")

    def map(self, va, size, handle):
        self._maybe_fail("map")
        self.inner.map(va, size, handle)

    def set_access(self, va, size):
        self._maybe_fail("set_access")
        self.inner.set_access(va, size)


def _manager(backend, num_units=8, residual_units=(2, 1), chunk_bytes=None):
    unit = backend.granularity()
    config = SumConfig(num_units=num_units, unit_bytes=unit, block_bytes=3 * unit // 8,
                       restore_chunk_bytes=chunk_bytes or unit // 2, restore_batch_units=2)
    manager = SumManager(backend, config)
    backup = ResidualBackup(backend.device)
    generator = torch.Generator().manual_seed(3)
    for layer, units in enumerate(residual_units):
        nbytes = units * unit - 64 * (layer + 1)  # not a whole number of units: the pad is never copied
        manager.register_residual(layer, nbytes)
        backup.add(layer, torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator))
    manager.attach_backup(backup)
    manager.load_residuals()
    return manager


def _kv(manager):
    unit = manager.config.unit_bytes
    return manager.kv_view(torch.float16, (manager.num_blocks, 3, 2, unit // 32))


def _residuals_match_backup(manager):
    return all(torch.equal(manager.residual_view(layer).cpu(), manager.backup.host(layer))
               for layer in manager.backup.layers())


def test_kv_view_and_residual_view_share_units(backend):
    manager = _manager(backend)
    try:
        assert _residuals_match_backup(manager) and manager.mode_for_next_step() == frozenset()
        kv = _kv(manager)
        everything = manager.alloc_blocks(manager.state.num_free_blocks(include_backed=True))
        assert manager.mode_for_next_step() == {0, 1}
        chunk = everything.taken_residuals[0]
        unit = manager.state.chunk_unit(chunk)
        block = manager.state.unit_blocks(unit)[0]
        kv[block].view(torch.uint8).fill_(0x5A)
        unit_bytes, block_bytes = manager.config.unit_bytes, manager.config.block_bytes
        offset = chunk.index * unit_bytes + block * block_bytes - unit * unit_bytes
        seen = manager.residual_range(chunk.layer).view(torch.uint8)[offset:offset + manager.config.block_bytes]
        assert torch.all(seen == 0x5A)  # the residual range still maps the unit now used for KV
    finally:
        manager.close()


def test_restore_onto_other_units_is_bit_exact_and_commits_between_steps(backend):
    manager = _manager(backend)
    try:
        kv = _kv(manager)
        everything = manager.alloc_blocks(manager.state.num_free_blocks(include_backed=True))
        old_units = {manager.state.chunk_unit(c) for c in everything.taken_residuals}
        kept = [b for b in everything.blocks if manager.state.unit_of_block(b) in old_units]
        kv[torch.tensor(kept, device=kv.device)] = 7.0
        manager.free_blocks([b for b in everything.blocks if b not in set(kept)])
        report = manager.between_steps()
        assert report.submitted > 0 and manager.mode_for_next_step() == {0, 1}
        manager._worker.drain()
        assert manager.mode_for_next_step() == {0, 1}  # copies are done, but only a step boundary commits
        report = manager.between_steps()
        assert len(report.committed) == 3 and not report.failed
        assert manager.mode_for_next_step() == frozenset()
        assert all(t.unit != t.previous_unit for t in report.committed)
        assert _residuals_match_backup(manager)
        assert torch.all(kv[torch.tensor(kept, device=kv.device)] == 7.0)  # KV in the old units untouched
        manager.state.check_invariants()
    finally:
        manager.close()


@pytest.mark.parametrize("failing_call", ["map", "set_access"])
def test_failed_restore_keeps_fp8_and_state_consistent(backend, failing_call):
    flaky = FlakyBackend(backend)
    manager = _manager(flaky)
    try:
        old_units = set(manager.evict_layers([0]))
        blocks = manager.alloc_blocks(manager.state.num_free_blocks()).blocks
        _kv(manager)[torch.tensor(blocks, device=manager.device)] = -3.0  # overwrite the evicted residual
        kept = [b for b in blocks if manager.state.unit_of_block(b) in old_units]
        manager.free_blocks([b for b in blocks if b not in set(kept)])  # restores must move to other units
        flaky.fail[failing_call] = 1
        manager.between_steps()
        report = manager.wait_restores()
        assert report.failed and manager.restore_failures == list(report.failed)
        assert manager.mode_for_next_step() == {0}
        assert not manager.state.restoring_tasks() and manager.state.num_stale_chunks() == 2
        manager.state.check_invariants()
        assert manager.state.num_backed_units() == 1  # layer 1 untouched
        manager.between_steps()  # retry with a healthy back-end
        assert all(t.unit not in old_units for t in manager.wait_restores().committed)
        assert manager.mode_for_next_step() == frozenset() and _residuals_match_backup(manager)
    finally:
        manager.close()


def test_restores_in_the_worker_never_disturb_kv_in_use(backend):
    manager = _manager(backend, num_units=10, residual_units=(2, 1, 2))
    rng = random.Random(11)
    kv = _kv(manager)
    held: dict[int, float] = {}
    committed = 0
    try:
        for step in range(120):
            if rng.random() < 0.55:
                n = rng.randint(1, 6)
                allow_backed = rng.random() < 0.5
                if manager.can_alloc(n, allow_backed):
                    for block in manager.alloc_blocks(n, allow_backed=allow_backed).blocks:
                        held[block] = float(step % 50)
                        kv[block] = held[block]
            elif held:
                chosen = rng.sample(sorted(held), rng.randint(1, len(held)))
                for block in chosen:
                    assert torch.all(kv[block] == held.pop(block)), f"KV block {block} was overwritten"
                manager.free_blocks(chosen)
            committed += len(manager.between_steps().committed)
            if step % 15 == 14:
                # Let the worker finish what it has (its copies ran beside the steps above): without it a loaded
                # 2-core CI machine once got through all 120 steps before any restore finished (session 16).
                committed += len(manager.wait_restores().committed)
            manager.state.check_invariants()
        assert committed > 0 and any(e.kind == "fast" for e in manager.state.mode_events)
        for block, tag in held.items():
            assert torch.all(kv[block] == tag)
        manager.free_blocks(list(held))
        for _ in range(6):
            manager.between_steps()
            manager.wait_restores()
        assert manager.mode_for_next_step() == frozenset()
        assert manager.state.units_in(UnitSet.RESTORING) == ()
        assert _residuals_match_backup(manager)
    finally:
        manager.close()


def test_configuration_errors_fail_at_startup(backend):
    unit = backend.granularity()
    with pytest.raises(ConfigError):
        SumConfig(num_units=2, unit_bytes=unit, block_bytes=2 * unit)
    with pytest.raises(ConfigError):
        SumManager(backend, SumConfig(num_units=2, unit_bytes=unit + unit // 2, block_bytes=unit // 2))
    manager = SumManager(backend, SumConfig(num_units=2, unit_bytes=unit, block_bytes=unit // 2))
    try:
        with pytest.raises(ConfigError):
            manager.register_residual(0, 3 * unit)
        with pytest.raises(ConfigError):
            manager.kv_view(torch.float16, (manager.num_blocks, unit))
        with pytest.raises(ConfigError):
            manager.load_residuals()
    finally:
        manager.close()
