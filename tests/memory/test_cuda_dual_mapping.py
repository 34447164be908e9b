"""CUDA only: kernels reading KV through the KV view keep running correctly while the residual mapping of the same
physical unit is dropped and re-made from the host (the KV mapping is never removed, so in-flight reads survive)."""

from __future__ import annotations

import pytest
import torch

from elastiserve.memory.residual_backup import ResidualBackup
from elastiserve.memory.sum_manager import SumConfig, SumManager

pytestmark = [pytest.mark.cuda]


def test_kv_reads_survive_residual_remaps(backend):
    unit = backend.granularity()
    manager = SumManager(backend, SumConfig(num_units=4, unit_bytes=unit, block_bytes=unit // 4))
    try:
        manager.register_residual(0, unit)
        backup = ResidualBackup(backend.device)
        backup.add(0, torch.zeros(unit, dtype=torch.uint8))
        manager.attach_backup(backup)
        manager.load_residuals()
        kv = manager.kv_view(torch.float16, (manager.num_blocks, unit // 8))
        taken = manager.alloc_blocks(manager.state.num_free_blocks(include_backed=True))
        (chunk,) = taken.taken_residuals
        shared_unit = manager.state.chunk_unit(chunk)
        blocks = torch.tensor(manager.state.unit_blocks(shared_unit), device=kv.device)
        pattern = torch.arange(unit // 8, device=kv.device, dtype=torch.float32).remainder(251).to(torch.float16)
        kv[blocks] = pattern
        expected = pattern.double().sum() * len(blocks)  # integers: exact in float64
        rng = manager.residual_range(0)
        handle = rng.handle_at(chunk.index)
        totals = []
        for _ in range(50):
            totals.append(kv[blocks].double().sum())  # queued on the compute stream while the host remaps
            rng.unmap_unit(chunk.index)
            rng.map_unit(chunk.index, handle)
        torch.cuda.synchronize()  # an illegal address would surface here
        assert all(float(t) == float(expected) for t in totals)
        assert torch.equal(manager.residual_view(0)[: unit // 4].view(torch.float16), pattern[: unit // 8])
    finally:
        manager.close()
