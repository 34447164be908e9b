"""Typed errors of the memory package.

``ConfigError`` (from platforms) is fatal at startup; ``PoolExhausted`` is the normal, transient "cannot allocate now";
``RestoreFailed`` is recorded when a residual restore aborts (the system keeps serving in FP8).
"""

from elastiserve.platforms.errors import BackendUnavailable, ConfigError, ElastiserveError

__all__ = ["BackendUnavailable", "BlockStateError", "ConfigError", "PoolExhausted", "RestoreFailed", "VMMError"]


class VMMError(ElastiserveError, RuntimeError):
    """A virtual-memory call (driver or libc) failed; the message names the call and the error code."""


class PoolExhausted(ElastiserveError):
    """Not enough KV blocks right now; nothing was changed. Callers preempt, demote or wait."""


class BlockStateError(ElastiserveError, ValueError):
    """A caller broke the block protocol (freed a block that is not allocated, committed an unknown restore)."""


class RestoreFailed(ElastiserveError, RuntimeError):
    """A residual restore did not complete; the residual stays stale and its layer stays in fast mode."""
