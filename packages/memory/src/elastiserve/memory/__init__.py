"""Elastic GPU memory: the VMM facade and back-ends, virtual tensors, Semi-Unified Memory and its restore worker.

``sum_state`` is plain Python (no torch); everything else imports torch lazily through its own module, so
``import elastiserve.memory`` stays cheap.
"""

from elastiserve.memory.errors import BlockStateError, PoolExhausted, RestoreFailed, VMMError
from elastiserve.memory.sum_state import AllocResult, ModeEvent, ResidualChunk, RestoreTask, SumState, UnitSet

__all__ = [
    "AllocResult",
    "BlockStateError",
    "ModeEvent",
    "PoolExhausted",
    "ResidualChunk",
    "RestoreFailed",
    "RestoreTask",
    "SumState",
    "UnitSet",
    "VMMError",
]
__version__ = "0.1.0"
