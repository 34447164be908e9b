"""A token budget for steps that carry prefill chunks, so that they stay under a step-time bound: the TBT half of a
joint SLO, learned from the engine's own recent steps, per precision mode.

Chunked prefill bounds a step by tokens (``max_num_batched_tokens``), but a token costs different time in different
modes. On the H200 (Qwen3-30B-A3B shapes, 80 GB budget, 2,048-token chunks, mixed-step CUDA graphs; benchmarks/
serving/results/moe-mixed-graphs-run2) static-fp16 met the DPS joint SLO (max TBT <= 5 x 24.65 ms) for every
finished request at 4 and 8 req/s, while dps, whose full mode reconstructs fp16 weights from two byte planes, broke
it for 93 of 214 requests at 4 req/s: its slowest full-mode steps took 126-135 ms, and each such step breaks the
TBT bound of every request running through it. Its fast-mode steps never did. Sarathi-Serve sizes its token budget
from the TBT SLO the same way, offline; here the budget follows the mode the engine is in.

Per mode (the number of fast layers) this keeps the last ``window`` chunk-carrying steps as (tokens, seconds),
fits seconds = a + b x tokens by least squares, and caps the next step's tokens at (bound - a - margin) / b, where
the margin is the largest residual of the fit: the bound is on a maximum, and one step over it breaks the TBT bound
of every running request; a single step far above the line of the others (a cold one) is left out of the fit. (The
simulator's steps are a deterministic function of the step, so there the margin hardly matters; a GPU's steps have
outliers, and those that recur should shrink the budget.) With enough steps but all of one
size it caps at the slowest kept seconds per token (no intercept): conservative, and the spread it creates lets the
fit take over. Below ``min_samples`` steps, or with a non-positive slope, it does not cap, unless the mode was
primed (``prime``) with steps timed before serving: those stand in until the mode's served steps give a line of
their own (``min_samples`` of them, with spread and a positive slope), and served steps above their line raise the
margin at once. The engine's scheduler
(``EngineConfig.max_step_time_s``) and the simulator's replicas (``ReplicaConfig.max_step_time_s``) use this one
class. Off by default in both; the H200 MoE headline runs use it since session 9 (``--max-step-time 0.11``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from elastiserve.platforms import ConfigError

PROBE_FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # of the chunk budget: the sizes of the steps that prime a mode


def probe_token_counts(budget: int) -> list[int]:
    """The sizes of the steps timed before serving to prime a mode (``StepBudget.prime``) for a chunk budget of
    ``budget`` tokens: distinct, so that the fit has spread (the engine's ``step_probe`` and the simulator's
    replicas)."""
    return sorted({max(1, int(budget * fraction)) for fraction in PROBE_FRACTIONS})


@dataclass(frozen=True, slots=True)
class StepBudgetConfig:
    max_step_time_s: float  # the bound: under the SLO's TBT bound (DPS: 5 x T_base)
    max_tokens: int  # the engine's max_num_batched_tokens: never above it
    min_tokens: int = 256  # never below it: a floor so that prefill always progresses
    window: int = 64  # chunk-carrying steps kept per mode
    min_samples: int = 8  # steps per mode before the budget caps anything

    def __post_init__(self) -> None:
        if not self.max_step_time_s > 0:
            raise ConfigError(f"max_step_time_s={self.max_step_time_s}: expected a positive number of seconds")
        if self.min_tokens < 1 or self.max_tokens < 1:
            raise ConfigError("min_tokens and max_tokens must be >= 1")
        if self.min_samples < 2 or self.window < self.min_samples:
            raise ConfigError(f"window={self.window}, min_samples={self.min_samples}: expected 2 <= min_samples "
                              "<= window")


@dataclass(frozen=True, slots=True)
class StepFit:
    intercept_s: float
    per_token_s: float
    margin_s: float  # the largest residual, >= 0
    samples: int


class StepBudget:
    def __init__(self, config: StepBudgetConfig) -> None:
        self.config = config
        self._steps: dict[int, deque[tuple[int, float]]] = {}
        self._priors: dict[int, tuple[tuple[int, float], ...]] = {}
        self._fits: dict[int, StepFit | None] = {}

    def prime(self, mode: int, steps: list[tuple[int, float]]) -> None:
        """Steps of ``mode`` timed before serving (the engine's probe, ``engine/step_probe.py``): fitted together with
        the served steps until ``min_samples`` of those exist, then dropped. Without them the first ``min_samples``
        chunk-carrying steps of each mode run uncapped: on the H200 (session 13, MoE headline, dps at 24 req/s with
        3,072-token chunks) the first eight full-mode steps took 136-154 ms against a 123 ms TBT bound, and 28 of
        the 87 misses were TBT."""
        if any(tokens < 1 or not seconds > 0 for tokens, seconds in steps):
            raise ConfigError(f"prime({mode}): every step needs tokens >= 1 and seconds > 0, got {steps}")
        self._priors[mode] = tuple(steps)
        self._fits.pop(mode, None)

    def record(self, mode: int, tokens: int, seconds: float) -> None:
        """One chunk-carrying step of ``tokens`` tokens (decodes included) that took ``seconds`` in ``mode``."""
        steps = self._steps.setdefault(mode, deque(maxlen=self.config.window))
        steps.append((tokens, seconds))
        self._fits.pop(mode, None)

    def fit(self, mode: int) -> StepFit | None:
        """The line of the mode's served steps once there are ``min_samples`` of them and they give one; until
        then the line of its primed and served steps together. Served steps need not give a line: on the H200
        (session 14, MoE headline, dps at 24 req/s, 3,072-token chunks) full mode's first eight were one cold step
        (374 tokens, 270 ms) and seven of 1,932 tokens (~103 ms), a negative slope; the budget dropped the priors
        all the same, borrowed fast mode's 3,072 tokens, and the ninth step ran them in full mode in 161 ms."""
        if mode not in self._fits:
            cfg = self.config
            served = tuple(self._steps.get(mode, ()))
            fit = _fit(served, cfg.min_samples, cfg.max_step_time_s)
            priors = self._priors.get(mode, ())
            if fit is None and priors:
                fit = _fit(priors + served, cfg.min_samples, cfg.max_step_time_s)
            self._fits[mode] = fit
        return self._fits[mode]

    def tokens(self, mode: int) -> int:
        """The token budget of the next step in ``mode``. A mode not learned yet borrows the smallest budget of the
        modes that are: a switch into a new mode would otherwise run ``min_samples`` uncapped steps (in simulation,
        on the Azure window at 8,192-token chunks and a 25 ms bound, borrowing took combined from 88.8 to 94.9 %
        joint-SLO attainment and dps from 60.1 to 64.8 %)."""
        cfg = self.config
        fit = self.fit(mode)
        if fit is not None:
            return self._cap(fit)
        steps = self._steps.get(mode, ())
        if len(steps) >= cfg.min_samples and all(x == steps[0][0] for x, _ in steps):
            return self._cap_without_spread(steps)
        learned = [self._cap(f) for m in {*self._steps, *self._priors} if m != mode and (f := self.fit(m)) is not None]
        return min(learned, default=cfg.max_tokens)

    def plan_tokens(self, mode: int, pending: int | None) -> int:
        """The next step's budget in ``mode``, or in ``pending`` when a switch to it was deferred (``defers``) and
        would otherwise be deferred again at every step that keeps carrying the faster mode's tokens."""
        return self.tokens(mode) if pending is None else min(self.tokens(mode), self.tokens(pending))

    def defers(self, mode: int, wanted: int, tokens: int) -> bool:
        """Whether a step scheduled at ``tokens`` (decodes included) in ``mode`` fast layers should run in ``mode``
        rather than switch to the slower ``wanted``: its tokens were budgeted for the faster mode, and leaving FP8 is
        never urgent (the upper plane stays valid). On the H200 (session 12, MoE headline, dps at 21 req/s) the
        queue trigger released fast mode after a 2,048-token step had been scheduled; that step ran in full mode
        in 132 ms, over the 123 ms TBT bound of the 74 requests running, against 1,412 tokens for full mode's
        own budget."""
        return wanted < mode and tokens > self.tokens(wanted)

    def _cap_without_spread(self, steps) -> int:
        """Every kept step carried the same tokens, so there is no line to fit, and borrowing would lock the budget:
        on the H200 (session 11, MoE headline, dps at 14 req/s) a cold 286 ms first step left the full-mode fit at
        the 256-token floor, fast mode borrowed it, and every later step carried 256 tokens, so fast mode never
        saw spread and never learned (TTFT P90 18.6 s; 100 % attainment at 16 and 18 req/s once the fit had
        forgotten that step). Assume no intercept, at the slowest kept step's seconds per token: a conservative
        cap that grows while steps stay under the bound, and the spread it creates lets the fit take over."""
        per_token_s = max(seconds / tokens for tokens, seconds in steps)
        if per_token_s <= 0:
            return self.config.max_tokens
        return self._clamp(math.floor(self.config.max_step_time_s / per_token_s))

    def _cap(self, fit: StepFit) -> int:
        cfg = self.config
        room = cfg.max_step_time_s - fit.intercept_s - fit.margin_s
        return self._clamp(math.floor(room / fit.per_token_s) if room > 0 else 0)

    def _clamp(self, tokens: int) -> int:
        cfg = self.config
        return max(min(cfg.min_tokens, cfg.max_tokens), min(cfg.max_tokens, tokens))


# A step counts as a one-off, and is left out of its mode's fit, when it lies this many times further above the line
# fitted without it than any other step does, and by over ONE_OFF_MIN_S_FRACTION of the bound.
ONE_OFF_FACTOR = 3.0
ONE_OFF_MIN_S_FRACTION = 0.1


def _fit(steps, min_samples: int, bound_s: float) -> StepFit | None:
    """The least-squares line of ``steps``, without the one step that is a one-off if there is one. On the H200
    (session 12, MoE headline, dps at 14 req/s) the engine's first step after start-up took 236 ms for 374 tokens
    against ~50 ms for such a step later; with it in the window full mode's slope came out negative, so the budget
    did not cap, and a 2,048-token full-mode step took 124 ms with 25 requests running (TBT bound 123 ms). Without
    it the same steps cap full mode at 2,025 tokens after nine steps and at 1,731 after ten."""
    if len(steps) < min_samples:
        return None
    fit = _line(steps)
    if len(steps) <= min_samples:
        return fit
    if fit is None:  # no line at all: the slowest step per token is the one that may have bent it
        worst = max(range(len(steps)), key=lambda i: steps[i][1] / steps[i][0])
    else:
        worst = max(range(len(steps)), key=lambda i: steps[i][1] - fit.intercept_s - fit.per_token_s * steps[i][0])
    rest = [step for i, step in enumerate(steps) if i != worst]
    refit = _line(rest)
    if refit is None:
        return fit
    tokens, seconds = steps[worst]
    excess = seconds - refit.intercept_s - refit.per_token_s * tokens
    if excess > ONE_OFF_FACTOR * refit.margin_s and excess > ONE_OFF_MIN_S_FRACTION * bound_s:
        return refit
    return fit


def _line(steps) -> StepFit | None:
    n = len(steps)
    mean_x = sum(x for x, _ in steps) / n
    mean_y = sum(y for _, y in steps) / n
    var_x = sum((x - mean_x) ** 2 for x, _ in steps)
    if var_x == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in steps) / var_x
    if slope <= 0:
        return None
    intercept = mean_y - slope * mean_x
    margin = max(0.0, max(y - (intercept + slope * x) for x, y in steps))
    return StepFit(intercept, slope, margin, n)
