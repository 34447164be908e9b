"""Typed errors of the serving engine."""

from __future__ import annotations

from elastiserve.platforms.errors import ElastiserveError


class InvalidRequest(ElastiserveError, ValueError):
    """A request that can never be served as given (bad sampling parameters, prompt too long, unknown id)."""


class EngineError(ElastiserveError, RuntimeError):
    """The engine reached a state it cannot continue from (out of KV with nothing left to preempt, device failure)."""


class RequestAborted(ElastiserveError):
    """The request was aborted (client disconnect or explicit abort) before it finished."""
