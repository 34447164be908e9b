"""Typed errors of the serving engine."""

from __future__ import annotations

from elastiserve.platforms.errors import ElastiserveError


class InvalidRequest(ElastiserveError, ValueError):
    """A request that can never be served as given (bad sampling parameters, prompt too long, unknown id)."""


class EngineError(ElastiserveError, RuntimeError):
    """The engine reached a state it cannot continue from (out of KV with nothing left to preempt, device failure)."""


class RequestAborted(ElastiserveError):
    """The request was aborted (client disconnect or explicit abort) before it finished."""


class DemotionFailed(EngineError):
    """A chunk of pairs failed to start demoting, before its pack kernel was enqueued: ``started`` are demoted as
    usual, ``failed`` never reached the device and go back to TARGET (``KVManager.cancel_demote``)."""

    def __init__(self, started: list, failed: list, cause: BaseException) -> None:
        super().__init__(f"demotion of {len(failed)} pair(s) failed to start ({type(cause).__name__}: {cause}); "
                         f"{len(started)} demoted")
        self.started, self.failed, self.cause = started, failed, cause


class PromotionFailed(EngineError):
    """Starting a pair promotion failed part way (no memory for the staging copy, a launch that raised): ``started``
    are in flight as usual, ``failed`` never reached the device and go back to BASE (``KVManager.cancel_promote``)."""

    def __init__(self, started: list, failed: list, cause: BaseException) -> None:
        super().__init__(f"promotion of {len(failed)} pair(s) failed to start ({type(cause).__name__}: {cause}); "
                         f"{len(started)} in flight")
        self.started, self.failed, self.cause = started, failed, cause
