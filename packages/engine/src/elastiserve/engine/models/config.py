"""The few HF config.json fields our model code reads, normalised across transformers 4.x and 5.x spellings."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastiserve.platforms import ConfigError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3"):
            raise ConfigError(f"rope_type {self.rope_type!r} is not supported (default, llama3)")
        if self.theta <= 0:
            raise ConfigError(f"rope theta must be positive, got {self.theta}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # MoE; num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r} is not supported; known: {SUPPORTED_ARCHITECTURES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} with {self.num_experts} experts")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _rope_config(hf: dict) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); 4.x writes rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "llama3":
        return RopeConfig(
            theta=float(theta),
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    return RopeConfig(theta=float(theta), rope_type=rope_type)


def _architecture(hf: dict) -> str:
    architectures = hf.get("architectures") or []
    if len(architectures) != 1:
        raise ConfigError(f"config.json must name exactly one architecture, got {architectures}")
    return architectures[0]


def _moe_fields(hf: dict, architecture: str, num_layers: int) -> dict:
    if architecture == "MixtralForCausalLM":
        # Mixtral's router renormalises over its top-k, i.e. a softmax over the selected logits.
        return {
            "num_experts": int(hf["num_local_experts"]),
            "num_experts_per_tok": int(hf["num_experts_per_tok"]),
            "moe_intermediate_size": int(hf["intermediate_size"]),
            "norm_topk_prob": True,
            "moe_layers": frozenset(range(num_layers)),
        }
    if architecture == "Qwen3MoeForCausalLM":
        step = int(hf.get("decoder_sparse_step", 1))
        dense_only = set(hf.get("mlp_only_layers") or [])
        return {
            # transformers 5 writes num_local_experts for Qwen3-MoE too; released checkpoints say num_experts.
            "num_experts": int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]),
            "num_experts_per_tok": int(hf["num_experts_per_tok"]),
            "moe_intermediate_size": int(hf["moe_intermediate_size"]),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "moe_layers": frozenset(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0),
        }
    return {}


def model_config_from_hf(hf: dict) -> ModelConfig:
    architecture = _architecture(hf)
    try:
        num_layers = int(hf["num_hidden_layers"])
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rope=_rope_config(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            **_moe_fields(hf, architecture, num_layers),
        )
    except KeyError as missing:
        raise ConfigError(f"config.json for {architecture} lacks {missing}") from None
