"""Step-time model for the simulator: time of one forward pass from batch shape and precision mode.

    t = host_overhead + max(weight read, batch_tokens x compute per token) + context KV read + demotion work

with weight read and compute interpolated between full and fast by the fraction of fast layers, and BASE context
tokens read at ``base_read_fraction`` of a TARGET token. Coefficients are data (a JSON carrying the device and
commit they came from); the shipped default is derived from H200 anchors and marked 'placeholder, not measured'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from elastiserve.platforms import ConfigError

DEFAULT_STEP_MODEL = "step_model_h200_llama31_8b.json"


@dataclass(frozen=True, slots=True)
class StepModel:
    host_overhead_s: float
    weight_read_full_s: float
    weight_read_fast_s: float
    compute_per_token_full_s: float
    compute_per_token_fast_s: float
    kv_read_per_token_s: float
    base_read_fraction: float
    demote_batch_s: float
    demote_per_pair_s: float
    promote_per_pair_s: float
    restore_per_unit_s: float
    residual_units_per_layer: int = 104
    device: str = "unknown"
    commit: str = "unknown"
    provenance: str = ""

    def __post_init__(self) -> None:
        numbers = [getattr(self, f.name) for f in fields(self) if f.type in ("float", "int")]
        if any(x < 0 for x in numbers):
            raise ConfigError("step-model coefficients must be >= 0")
        if not 0 < self.base_read_fraction <= 1:
            raise ConfigError("base_read_fraction must lie in (0, 1]")

    def step_time(
        self,
        batch_tokens: int,
        context_tokens: int,
        base_context_tokens: int = 0,
        fast_fraction: float = 0.0,
        demoted_pairs: int = 0,
    ) -> float:
        """Seconds for one step. ``fast_fraction`` is the fraction of decoder layers in fast (FP8) mode."""
        if batch_tokens <= 0:
            return 0.0
        f = min(1.0, max(0.0, fast_fraction))
        weights = (1 - f) * self.weight_read_full_s + f * self.weight_read_fast_s
        compute = batch_tokens * ((1 - f) * self.compute_per_token_full_s + f * self.compute_per_token_fast_s)
        target_tokens = context_tokens - base_context_tokens
        kv = self.kv_read_per_token_s * (target_tokens + self.base_read_fraction * base_context_tokens)
        demotion = (self.demote_batch_s + self.demote_per_pair_s * demoted_pairs) if demoted_pairs else 0.0
        return self.host_overhead_s + max(weights, compute) + kv + demotion

    def base_tpot(self, context_tokens: int = 1024) -> float:
        """T_base of the DPS SLO: an unloaded single-request decode step in full mode."""
        return self.step_time(1, context_tokens)


def load_step_model(path: Path | None = None) -> StepModel:
    """Load coefficients from ``path`` or the packaged default; unknown keys are ignored."""
    if path is None:
        text = (resources.files("elastiserve.control") / "data" / DEFAULT_STEP_MODEL).read_text()
    else:
        text = Path(path).read_text()
    raw = json.loads(text)
    known = {f.name for f in fields(StepModel)}
    missing = known - set(raw) - {"residual_units_per_layer", "device", "commit", "provenance"}
    if missing:
        raise ConfigError(f"step model is missing {sorted(missing)}")
    return StepModel(**{k: v for k, v in raw.items() if k in known})
