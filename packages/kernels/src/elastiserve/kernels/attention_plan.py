"""Host-side attention metadata: pick the pair-read path for a batch and fill fixed-size buffers.

The caller owns one :class:`AttentionPlanBuffers` sized for its largest batch (CUDA-graph friendly: the device
tensors never move). :func:`plan_attention` works on the host in numpy and issues at most one host-to-device copy
(none for the native path). The device buffer is a single byte tensor: ``base_bounds`` (int32 [max_batch, 2]) and
``pair_mode`` (uint8 [max_batch, max_pairs]) are views of it, so one copy moves whichever the path needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from elastiserve.platforms import ConfigError

NATIVE, STRUCTURED, GENERAL = 0, 1, 2
STRUCTURED_SPLIT = 3  # path 1's layout read by two launches (attention.py); the planner's choice for T*B*T*
# Why path 3 and not path 1 for structured batches: on the H200 (64 sequences x 4096 tokens, CUDA-graph replay,
# benchmarks/kernels/results/h200-attention-run2) path 3 reads an all-BASE batch at 1.47x the native kernel's speed
# (path 1: 1.16x) and a 15 %-BASE batch at 0.99x (path 1: 0.80x): each launch keeps the native kernel's 4 CTAs per SM.
# Prefill tiles fall back to path 1 inside the op (the split launch merges flash-decoding partials).
STRUCTURED_READ_PATH = STRUCTURED_SPLIT


@dataclass(frozen=True, slots=True)
class AttentionPlanConfig:
    max_batch: int
    max_pairs: int  # per sequence: cdiv(max_blocks_per_seq, 2)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_pairs < 1:
            raise ConfigError(f"max_batch and max_pairs must be >= 1, got {self.max_batch}, {self.max_pairs}")


class AttentionPlanBuffers:
    """Preallocated host staging and device buffers for attention metadata."""

    def __init__(self, config: AttentionPlanConfig, device: torch.device | str) -> None:
        self.config = config
        device = torch.device(device)
        self.bounds_bytes = 8 * config.max_batch
        total = self.bounds_bytes + config.max_batch * config.max_pairs
        pin = device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        self.device = torch.zeros(total, dtype=torch.uint8, device=device)
        self._host_np = self.host.numpy()
        self.host_bounds = self._host_np[: self.bounds_bytes].view(np.int32).reshape(config.max_batch, 2)
        self.host_modes = self._host_np[self.bounds_bytes :].reshape(config.max_batch, config.max_pairs)
        self.base_bounds = self.device[: self.bounds_bytes].view(torch.int32).view(config.max_batch, 2)
        self.pair_mode = self.device[self.bounds_bytes :].view(config.max_batch, config.max_pairs)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """What :func:`elastiserve.kernels.attention.paged_attention` needs beyond the block tables."""

    path: int
    base_bounds: torch.Tensor  # int32 [max_batch, 2] device view; valid rows [:batch] when path is 1 or 3
    pair_mode: torch.Tensor  # uint8 [max_batch, max_pairs] device view; valid rows [:batch] when path == 2


def _base_run(modes: Sequence[int] | np.ndarray) -> tuple[int, int] | None:
    """[first BASE pair, end of the last BASE pair) when the BASE pairs are one contiguous run ((0, 0) without any),
    else None."""
    where = np.flatnonzero(np.asarray(modes, dtype=np.uint8))
    if where.size == 0:
        return 0, 0
    first, end = int(where[0]), int(where[-1]) + 1
    return (first, end) if where.size == end - first else None


def choose_path(pair_modes: Sequence[Sequence[int] | np.ndarray]) -> tuple[int, list[tuple[int, int]]]:
    """Path for the batch: native without BASE pairs, structured (read by ``STRUCTURED_READ_PATH``) when every
    sequence is T*B*T*, else general."""
    if all(len(modes) == 0 for modes in pair_modes):  # an engine's all-TARGET batch: no per-pair scan
        return NATIVE, []
    return choose_path_from_bounds([_base_run(modes) for modes in pair_modes])


def choose_path_from_bounds(bounds: Sequence[tuple[int, int] | None]) -> tuple[int, list[tuple[int, int]]]:
    """:func:`choose_path` for callers that track each sequence's BASE pairs: ``(first, end)`` when they are one run
    ((0, 0) without any), None when they are not (the general path; the caller then fills the pair-mode table)."""
    if None in bounds:
        return GENERAL, []
    if all(first == end for first, end in bounds):
        return NATIVE, []
    return STRUCTURED_READ_PATH, list(bounds)


def plan_attention(
    pair_modes: Sequence[Sequence[int] | np.ndarray], buffers: AttentionPlanBuffers, *, non_blocking: bool = True
) -> AttentionPlan:
    """Plan one step's attention metadata.

    Parameters
    ----------
    pair_modes : one entry per sequence of the batch: per pair 1 = BASE, 0 = TARGET (uint8 numpy arrays are the
        cheap form; lists work). A trailing single-block pair must be TARGET.
    buffers : the caller's preallocated buffers; rows ``[:len(pair_modes)]`` are written.

    Returns an :class:`AttentionPlan`; its tensors are views of ``buffers.device``.

    Example
    -------
    >>> bufs = AttentionPlanBuffers(AttentionPlanConfig(max_batch=4, max_pairs=8), "cpu")
    >>> plan_attention([[0, 1, 1, 0], [0, 0]], bufs).path
    3
    """
    config = buffers.config
    batch = len(pair_modes)
    if batch > config.max_batch:
        raise ConfigError(f"batch {batch} exceeds the planned max_batch {config.max_batch}")
    path, bounds = choose_path(pair_modes)
    if path in (STRUCTURED, STRUCTURED_SPLIT):
        buffers.host_bounds[:batch] = np.asarray(bounds, dtype=np.int32).reshape(batch, 2)
        _copy(buffers, 0, 8 * batch, non_blocking)
    elif path == GENERAL:
        modes = buffers.host_modes
        modes[:batch] = 0
        for seq, flags in enumerate(pair_modes):
            flags = np.asarray(flags, dtype=np.uint8)
            if flags.size > config.max_pairs:
                raise ConfigError(f"sequence {seq} has {flags.size} pairs, more than max_pairs {config.max_pairs}")
            modes[seq, : flags.size] = flags
        _copy(buffers, buffers.bounds_bytes, buffers.bounds_bytes + batch * config.max_pairs, non_blocking)
    return AttentionPlan(path, buffers.base_bounds, buffers.pair_mode)


def _copy(buffers: AttentionPlanBuffers, begin: int, end: int, non_blocking: bool) -> None:
    # The single H2D copy of the step. A non-blocking copy from pinned memory is ordered on the current stream,
    # so the next step's host writes must wait for it: the engine plans after the previous step's sync point.
    buffers.device[begin:end].copy_(buffers.host[begin:end], non_blocking=non_blocking)
