"""Typed errors of the serving engine."""

from __future__ import annotations

from elastiserve.platforms.errors import ElastiserveError


class InvalidRequest(ElastiserveError, ValueError):
    """A request that can never be served as given (bad sampling parameters, prompt too long, unknown id)."""


class EngineError(ElastiserveError, RuntimeError):
    """The engine reached a state it cannot continue from (out of KV with nothing left to preempt, device failure)."""


class RequestAborted(ElastiserveError):
    """The request was aborted (client disconnect or explicit abort) before it finished."""


class PairTransferFailed(EngineError):
    """Starting a chunk of pair transfers failed before it reached the device (no memory for its indices or staging
    copy, a launch that raised): ``started`` went ahead as usual, ``failed`` did not and go back to their state."""

    ACTION, DONE = "transfer", "started"

    def __init__(self, started: list, failed: list, cause: BaseException) -> None:
        super().__init__(f"{self.ACTION} of {len(failed)} pair(s) failed to start ({type(cause).__name__}: {cause}); "
                         f"{len(started)} {self.DONE}")
        self.started, self.failed, self.cause = started, failed, cause


class DemotionFailed(PairTransferFailed):
    """The failed pairs go back to TARGET (``KVManager.cancel_demote``): their pack kernel never ran."""

    ACTION, DONE = "demotion", "demoted"


class PromotionFailed(PairTransferFailed):
    """The failed pairs stay BASE (``KVManager.cancel_promote``); the started ones are in flight."""

    ACTION, DONE = "promotion", "in flight"
