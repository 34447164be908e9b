"""Functions ``TPRunner.on_every_rank`` runs on each tensor-parallel rank; the workers import them by name, so they
live here, away from the test modules' heavier imports."""

from __future__ import annotations

import torch


def kv_heads(runner) -> int:
    return runner.kv_cache.shape[3]


def books(runner) -> tuple:
    """This rank's Algorithm 1 books: which set each unit is in, free blocks, fast layers (checked consistent)."""
    state = runner.pool.block_pool.state
    state.check_invariants()
    units = tuple(state.set_of(u) for u in range(state.num_units))
    return units, state.num_free_blocks(True), state.num_free_blocks(False), tuple(sorted(state.fast_layers))


def kv_blocks(runner, blocks: list[int]) -> torch.Tensor:
    return runner.kv_cache[blocks].clone()


def clobber_blocks(runner, blocks: list[int]) -> None:
    """Use blocks as KV would: overwrite them (on units reclaimed from residuals this clobbers the lower planes)."""
    generator = torch.Generator().manual_seed(len(blocks))
    runner.kv_cache[blocks] = torch.randn(runner.kv_cache[blocks].shape, generator=generator).half()


def lower_planes(runner) -> dict[str, torch.Tensor]:
    from elastiserve.engine.nested_weights import layer_lower_planes

    return {f"{layer}.{i}": m.lower.clone() for layer, mods in layer_lower_planes(runner.model).items()
            for i, m in enumerate(mods)}  # fmt: skip
