"""Control-plane configuration: frozen dataclasses checked on construction, and the five named presets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from elastiserve.platforms import ConfigError

DEMOTION_TRIGGERS = ("shortage", "watermark")
PROMOTION_POLICIES = ("reserve", "eager", "none")
F_POST_RULES = ("committed", "free")
GRANULARITIES = ("model", "layer")
MECHANISMS = ("demote", "evict", "preempt")
PRESETS = ("static-fp16", "static-fp8", "dps", "elastickv", "combined")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True, slots=True)
class KVFidelityConfig:
    """ElasticKV Algorithm 1 knobs (paper App. B.1 defaults: B_min = 16 pairs, lambda = 2 blocks per step).

    ``demotion_trigger="watermark"`` and ``promotion`` in {"eager", "none"} are the paper's ablation variants.
    ``max_base_fraction`` caps BASE pairs as a fraction of all resident pairs (1.0 = no cap).
    ``f_post``: the free capacity F_post that promotion may spend. ``"committed"`` (default, our design) subtracts
    what progress has already committed to: the remaining chunks of admitted prompts and the prompts of queued
    requests that fit in free sequence slots (otherwise promotions take blocks that the next steps' admissions need,
    and demotion follows at once). ``"free"`` is the paper's F_post, the free blocks left after scheduling: a queued
    prompt gets only what promotion has not taken, and only the reserve R_t protects it.
    ``demand_includes_admissions``: whether the dry-run demand D_t counts the blocks of requests the step would
    newly admit. Off (default), demotion only protects running work from preemption, as vLLM's native scheduler
    admits a request only into free blocks; on, demotion also makes room for admissions (higher BASE exposure).
    ``admission``: ``"free"`` admits whatever the free blocks hold (vLLM); ``"base-floor"`` admits a request only
    while every admitted request could still reach prompt + max tokens with its unprotected pairs in BASE
    (`elastiserve.control.admission`), so admitting does not lead to preemption. ``admission_output_clip`` caps the
    max tokens it reserves per request (SGLang clips its estimate at 4,096 too): a chat request without max_tokens
    would otherwise reserve the whole context and hold the batch to a few requests.
    """

    b_min: int = 16
    reserve_decay: int = 2
    sink_pairs: int = 1
    recent_pairs: int = 2
    demotion_trigger: str = "shortage"
    watermark: int = 64
    promotion: str = "reserve"
    max_base_fraction: float = 1.0
    max_promotions_in_flight: int = 64
    f_post: str = "committed"
    demand_includes_admissions: bool = False
    admission: str = "free"
    admission_output_clip: int = 4096

    def __post_init__(self) -> None:
        _require(self.b_min >= 1, f"b_min must be >= 1, got {self.b_min}")
        _require(self.reserve_decay >= 0, f"reserve_decay must be >= 0, got {self.reserve_decay}")
        _require(self.sink_pairs >= 0 and self.recent_pairs >= 0, "sink_pairs and recent_pairs must be >= 0")
        _require(self.admission in ("free", "base-floor"), "admission must be 'free' or 'base-floor'")
        _require(self.admission_output_clip >= 1, "admission_output_clip must be >= 1")
        _require(self.demotion_trigger in DEMOTION_TRIGGERS, f"demotion_trigger must be one of {DEMOTION_TRIGGERS}")
        _require(self.watermark >= 0, f"watermark must be >= 0, got {self.watermark}")
        _require(self.promotion in PROMOTION_POLICIES, f"promotion must be one of {PROMOTION_POLICIES}")
        _require(self.f_post in F_POST_RULES, f"f_post must be one of {F_POST_RULES}")
        _require(0.0 <= self.max_base_fraction <= 1.0, "max_base_fraction must lie in [0, 1]")
        _require(self.max_promotions_in_flight >= 1, "max_promotions_in_flight must be >= 1")


@dataclass(frozen=True, slots=True)
class PrecisionConfig:
    """DPS section IV-D: occupancy thresholds with hysteresis, batch-aligned switching, restore only into FREE units.

    Occupancy is used KV blocks over the FP16 (native) KV budget, so it can exceed 1 in fast mode.
    ``restore_dwell_s``: occupancy must have stayed below kappa_low (with no shortage) this long before a restore
    starts. Thresholds alone flap when the mode itself changes throughput (fast mode drains the queue, full mode
    refills it); the dwell turns that into a few long windows.
    ``static_fast`` is the static-FP8 baseline: every residual evicted from the start and never restored.
    ``min_evict_layers`` (per-layer granularity): evict at least this many layers at once, ElasticKV's B_min applied
    to layers. Sized to the shortage alone, a burst on the H200 (reduced dense headline, combined) evicted 11 times
    in 1-5 layer steps, each a new mix of full and fast layers whose decode graphs were captured mid-run.
    ``layer_groups`` (per-layer granularity): the layers form this many contiguous groups and a group runs fast
    whole when any of its layers is stale, so the runner meets few mixes and captures the group prefixes' graphs
    before serving. With a mix per fast prefix length, combined on the H200 MoE setting (48 layers, 28 evicted,
    mixed-step graphs) met TBT bounds for 12.5 % of requests at 12 req/s against dps's 97.8 %: each new mix ran
    eagerly or captured its graphs inside a step (benchmarks/serving/results/moe-step-budget-run2).
    ``queue_fast_s`` (off when None): run every layer in FP8, residuals kept resident, while some request has waited
    this long for its first token, and for ``queue_fast_hold_s`` after the last step that saw it. This is precision
    as compute: nothing is evicted, so going back to full costs no restore. On the H200 MoE headline (session 10,
    dps at 14 req/s) every request that missed the 2 s TTFT bound arrived while dps still ran full mode with KV
    below kappa_high and 18-27 prompts queued; after the KV-driven switch, none missed it.
    ``prefill_fast``: a step that carries a prefill chunk also runs every layer fast (residuals kept), so a prompt's
    first token never waits on full-mode prefill while decode-only steps keep their resident layers exact. At a
    closed-loop client's concurrency 38 (dense, half scale, H100, session 47) combined with the queue rule alone kept
    43 % of its layer-time full and its P90 TTFT 0.32 s stayed 0.01 s behind dps's: each new prompt arrived as a
    request finished, had waited ~0 s at the next step and ran its 2,048-token prefill with half the layers full.
    The prompt's KV is then computed from FP8 weights, as in dps's fast mode.
    """

    kappa_low: float = 0.6
    kappa_high: float = 0.95
    granularity: str = "model"
    restore_min_free_units: int = 2
    restore_dwell_s: float = 5.0
    static_fast: bool = False
    min_evict_layers: int = 1
    layer_groups: int = 4
    queue_fast_s: float | None = None
    queue_fast_hold_s: float = 2.0
    prefill_fast: bool = False

    def __post_init__(self) -> None:
        _require(0.0 <= self.kappa_low < self.kappa_high, "need 0 <= kappa_low < kappa_high (hysteresis band)")
        _require(self.granularity in GRANULARITIES, f"granularity must be one of {GRANULARITIES}")
        _require(self.restore_min_free_units >= 0, "restore_min_free_units must be >= 0")
        _require(self.restore_dwell_s >= 0, "restore_dwell_s must be >= 0")
        _require(self.min_evict_layers >= 1, "min_evict_layers must be >= 1")
        _require(self.layer_groups >= 1, "layer_groups must be >= 1")
        _require(self.queue_fast_s is None or self.queue_fast_s > 0, "queue_fast_s must be > 0 (or None: off)")
        _require(self.queue_fast_hold_s >= 0, "queue_fast_hold_s must be >= 0")


@dataclass(frozen=True, slots=True)
class ArbiterConfig:
    """Cost model of the arbiter. Costs are in one abstract unit: 'quality-seconds per freed block'.

    A degradation that frees a block costs ``quality_cost_per_block`` for every second the pressure lasts plus a
    one-off ``transition_latency_s`` weighted by ``latency_weight``. Preemption has no quality cost but throws away
    work: ``preempt_cost_per_block`` stands for the recompute (seconds of prefill per freed block, weighted).
    ``pressure_duration_s`` seeds an exponential moving average (weight ``duration_ewma``) of observed pressure
    episode lengths, the 'expected pressure duration'.
    """

    mechanisms: tuple[str, ...] = ("evict", "demote", "preempt")
    demote_quality_cost_per_block: float = 1.0
    evict_quality_cost_per_block: float = 0.05
    preempt_cost_per_block: float = 50.0
    demote_latency_s: float = 2e-5
    evict_latency_s: float = 0.0
    latency_weight: float = 1.0
    pressure_duration_s: float = 10.0
    duration_ewma: float = 0.3

    def __post_init__(self) -> None:
        _require(len(self.mechanisms) > 0, "mechanisms must not be empty")
        _require(all(m in MECHANISMS for m in self.mechanisms), f"mechanisms must be drawn from {MECHANISMS}")
        _require(len(set(self.mechanisms)) == len(self.mechanisms), "mechanisms must not repeat")
        costs = (self.demote_quality_cost_per_block, self.evict_quality_cost_per_block, self.preempt_cost_per_block)
        _require(all(c >= 0 and math.isfinite(c) for c in costs), "costs must be finite and >= 0")
        _require(self.demote_latency_s >= 0 and self.evict_latency_s >= 0, "latencies must be >= 0")
        _require(self.latency_weight >= 0, "latency_weight must be >= 0")
        _require(self.pressure_duration_s > 0, "pressure_duration_s must be > 0")
        _require(0.0 < self.duration_ewma <= 1.0, "duration_ewma must lie in (0, 1]")

    def cost_per_block(self, mechanism: str, expected_duration_s: float, blocks: int) -> float:
        """Per-block cost of freeing capacity with ``mechanism`` for a pressure episode of the given length.
        ``blocks`` is the mechanism's granule (a layer's blocks for eviction): its one-off latency is shared by it."""
        blocks = max(1, blocks)
        d, w = expected_duration_s, self.latency_weight
        if mechanism == "preempt":
            return self.preempt_cost_per_block
        if mechanism == "demote":
            return self.demote_quality_cost_per_block * d + w * self.demote_latency_s
        return self.evict_quality_cost_per_block * d + w * self.evict_latency_s / blocks


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """Everything the control plane needs; ``name`` is the preset it came from (or 'custom')."""

    name: str = "custom"
    kv: KVFidelityConfig = field(default_factory=KVFidelityConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    arbiter: ArbiterConfig = field(default_factory=ArbiterConfig)

    def __post_init__(self) -> None:
        _require(isinstance(self.kv, KVFidelityConfig), "kv must be a KVFidelityConfig")
        _require(isinstance(self.precision, PrecisionConfig), "precision must be a PrecisionConfig")
        _require(isinstance(self.arbiter, ArbiterConfig), "arbiter must be an ArbiterConfig")
        compute_rule = self.precision.queue_fast_s is not None or self.precision.prefill_fast
        _require(not compute_rule or "evict" in self.arbiter.mechanisms,
                 "precision.queue_fast_s and prefill_fast need nested weights: a configuration that evicts residuals "
                 "(dps, combined)")

    @property
    def uses_demotion(self) -> bool:
        return "demote" in self.arbiter.mechanisms

    @property
    def demand_counts_admissions(self) -> bool:
        """Whether D_t includes the blocks of requests the next step would admit. Demotion answers only running
        work unless ``kv.demand_includes_admissions``; without demotion (dps), eviction also makes room for new
        requests. The simulator and the engine both ask this."""
        return self.kv.demand_includes_admissions or not self.uses_demotion

    @property
    def uses_eviction(self) -> bool:
        return "evict" in self.arbiter.mechanisms or self.precision.static_fast

    def with_engine_admission(self) -> ControlConfig:
        """What `elastiserve.engine` runs (same name): D_t counts admissions, bounded by base-floor admission when
        the configuration demotes (packages/control/README.md, "Demand and admissions")."""
        admission = "base-floor" if self.uses_demotion else "free"
        return replace(self, kv=replace(self.kv, demand_includes_admissions=True, admission=admission))

    def with_precision(self, **changes: object) -> ControlConfig:
        """A copy with some precision fields changed (same name: e.g. the engine's ``queue_fast_after_s``)."""
        return replace(self, precision=replace(self.precision, **changes))

    def with_kv(self, **changes: object) -> ControlConfig:
        """A copy with some KV-fidelity fields changed (used for the ElasticKV ablations)."""
        return replace(self, name=f"{self.name}*", kv=replace(self.kv, **changes))


def preset(name: str) -> ControlConfig:
    """The named configurations compared in the evaluation (see module docstring of ``arbiter``)."""
    if name == "static-fp16":
        return ControlConfig(name=name, arbiter=ArbiterConfig(mechanisms=("preempt",)))
    if name == "static-fp8":
        return ControlConfig(
            name=name, precision=PrecisionConfig(static_fast=True), arbiter=ArbiterConfig(mechanisms=("preempt",))
        )
    if name == "dps":
        return ControlConfig(name=name, arbiter=ArbiterConfig(mechanisms=("evict", "preempt")))
    if name == "elastickv":
        return ControlConfig(name=name, arbiter=ArbiterConfig(mechanisms=("demote", "preempt")))
    if name == "combined":
        return ControlConfig(
            name=name,
            precision=PrecisionConfig(granularity="layer", min_evict_layers=4),
            arbiter=ArbiterConfig(mechanisms=("evict", "demote", "preempt")),
        )
    raise ConfigError(f"unknown preset {name!r}; choose one of {PRESETS}")
