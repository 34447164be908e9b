"""Engine configuration: one frozen dataclass, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from elastiserve.platforms import ConfigError

POLICIES = ("static-fp16", "static-fp8", "dps", "elastickv", "combined")
NESTED_POLICIES = ("static-fp8", "dps", "combined")  # weights held as nested planes
SWITCHING_POLICIES = ("dps", "combined")  # nested weights whose precision changes at run time
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("float16",)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    dtype: str = "float16"
    device: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    gpu_memory_budget: int | None = None  # absolute cap in bytes, e.g. to emulate an 80 GB GPU on a bigger one
    kv_cache_budget: int | None = None  # bytes for the KV pool; overrides the utilization-derived size
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # chunked-prefill token budget of one step
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    policy: str = "static-fp16"
    tensor_parallel_size: int = 1
    tp_timeout_s: float | None = None  # TP rendezvous and collectives fail after this long; None: torch's default
    load_format: str = "auto"
    enforce_eager: bool = False
    graph_capture_after: int = 8  # a decode graph first needed mid-run is captured at its 8th use (graphs.py)
    # Steps that carry prefill chunks replay graphs too, padded to token and sequence buckets (graphs.py). On the H200
    # it took the MoE headline's static-fp16 from 0 to 8 req/s of joint-SLO capacity (BENCHMARKS.md, session 8), but
    # each engine start captures 60-120 more graphs (17-29 s there) and the dense settings are not measured with it.
    mixed_graphs: bool = False
    # Cap the tokens of steps that carry prefill chunks so that they take at most this long, per precision mode,
    # from the engine's recent steps (step_budget.py), primed on a GPU with probe steps timed after warm-up
    # (step_probe.py); None: every step may take max_num_batched_tokens.
    max_step_time_s: float | None = None
    # dps / combined: run every layer in FP8 (residuals kept resident, so going back costs nothing) while a request
    # has waited this long for its first token (control PrecisionConfig.queue_fast_s); None: memory alone decides.
    queue_fast_after_s: float | None = None
    # ... and for this long after the last step that saw such a request (None: the control default, 2 s). The
    # simulator at the H100-fitted step model, dense half scale, concurrency 38: combined at 0.1 s with a 0.25 s hold
    # ran 57 % FP8 layer-time against 70 % at 2 s, at the same P90 TTFT (BENCHMARKS.md, session 45).
    queue_fast_hold_s: float | None = None
    # dps / combined: a step that carries a prefill chunk runs every layer in FP8 too (residuals kept), so no prompt
    # waits on a full-mode prefill (control PrecisionConfig.prefill_fast). The simulator at the H100 step model, dense
    # half scale, concurrency 38: combined's P90 TTFT 0.30 -> 0.29 s, dps's, at 62 % FP8 layer-time against 100 %.
    prefill_fast: bool = False
    # Nested policies: nest lm_head too, so that it reads its upper plane only while the last decoder layer runs fast
    # (per-layer eviction reaches that layer last: every layer is fast by then). Its lower plane is part of the last
    # layer's residual: evicted into KV and restored with it. Off by default, as serving systems keep lm_head 16-bit
    # under FP8 (vLLM's GPTQ ``lm_head_quantized`` is opt-in too): its logits move in fast mode, and in full mode from
    # 65 rows (batches of 65+) it runs full mode's merge-then-cuBLAS path (a 1 GB scratch for Llama-8B's head). A tied
    # lm_head gets planes of its own, and the embedding keeps its fp16 table.
    nest_lm_head: bool = False
    # With nest_lm_head: in fast mode the head's largest logits a row, this many, are recomputed from its exact fp16
    # rows (NestedLinear.exact_top). On SmolLM2 (CPU quality table) 16 keep fast mode's top-1 agreement and greedy
    # outputs (94.2 %, as with a 16-bit head, against 90.7 % for the FP8 head) and cut the head's perplexity cost from
    # +0.34 to +0.11 (64: +0.07). The head's lower plane is then read in fast mode, so it stays resident (out of the
    # last layer's residual: not lent to KV). 0: off.
    lm_head_exact_top: int = 0
    # Reuse the KV of complete pairs whose tokens (and every token before them) match an earlier request's
    # (prefix_cache.py). While weight residuals are evicted, unused pairs are not retained (restore needs the units).
    enable_prefix_caching: bool = False
    # On a GPU, the collector's passes run after a step's forward is queued, while the device works, instead of
    # wherever an allocation trips them (gc_watch.py); False: CPython's automatic collection.
    gc_in_step_shadow: bool = True
    seed: int = 0
    # "priority": requests carry a priority (lower first) that orders the queue and picks preemption victims
    # (scheduler.py); "fcfs": arrival order, and a request with a priority other than 0 is refused
    scheduling_policy: str = "fcfs"
    host_backing_bytes: int | None = None  # host memory for demoted pairs' low bytes; None: as large as the KV pool
    sink_pairs: int = 1  # leading pairs of each sequence never demoted (attention sinks)
    recent_pairs: int = 2  # trailing complete pairs never demoted (recent tokens)
    cpu_kv_blocks: int = 512  # KV pool size on the CPU, where there is no device memory to size from

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("policy", self.policy, POLICIES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        if not self.model:
            raise ConfigError("model must name a model directory or a known model name")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size}: expected a power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization}: expected a value in (0, 1]")
        for name in ("gpu_memory_budget", "kv_cache_budget", "host_backing_bytes", "max_model_len", "tp_timeout_s",
                     "max_step_time_s", "queue_fast_after_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name}={value}: expected a positive number or None")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "cpu_kv_blocks",
                     "graph_capture_after"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: expected at least 1")
        if self.sink_pairs < 0 or self.recent_pairs < 0:
            raise ConfigError("sink_pairs and recent_pairs must be >= 0")
        if self.queue_fast_hold_s is not None and (self.queue_fast_hold_s < 0 or self.queue_fast_after_s is None):
            raise ConfigError(f"queue_fast_hold_s={self.queue_fast_hold_s}: expected >= 0, with queue_fast_after_s set")
        for name in ("queue_fast_after_s", "prefill_fast"):
            if getattr(self, name) not in (None, False) and self.policy not in SWITCHING_POLICIES:
                raise ConfigError(f"{name} needs a policy that can switch precision {SWITCHING_POLICIES}, "
                                  f"not {self.policy!r}")
        if self.nest_lm_head and not self.uses_nested_weights:
            raise ConfigError(f"nest_lm_head needs a policy with nested weights {NESTED_POLICIES}, not {self.policy!r}")
        if self.lm_head_exact_top < 0:
            raise ConfigError(f"lm_head_exact_top={self.lm_head_exact_top}: expected 0 (off) or more")
        if self.lm_head_exact_top and not self.nest_lm_head:
            raise ConfigError("lm_head_exact_top needs nest_lm_head: a 16-bit head's logits are exact already")
        if self.max_model_len is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be positive")

    @property
    def uses_nested_weights(self) -> bool:
        return self.policy in NESTED_POLICIES

    @property
    def uses_kv_demotion(self) -> bool:
        return self.policy in ("elastickv", "combined")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")
