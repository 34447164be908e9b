"""Model definitions in plain PyTorch: ``build_model(hf_config, dtype=, device=) -> CausalLM``."""

from __future__ import annotations

import torch

from elastiserve.engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig, model_config_from_hf
from elastiserve.engine.models.decoder import CausalLM, WeightLoadError
from elastiserve.engine.models.layers import AttentionContext, RotaryEmbedding
from elastiserve.engine.models.moe import SparseMoeBlock, grouped_gemm_reference, moe_experts, route_topk


def build_model(hf_config: dict, *, dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu") -> CausalLM:
    """A model with the config's shapes, parameters in ``dtype`` on ``device`` and UNINITIALISED.

    Fill it with ``load_weights`` (or ``elastiserve.engine.loader.init_dummy_weights``). Built on the meta device
    first so an 8B model never materialises fp32 weights or runs nn.Linear's init.
    """
    config = model_config_from_hf(hf_config)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty unties shared parameters
    model.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings).to(device)
    return model.eval().requires_grad_(False)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionContext",
    "CausalLM",
    "ModelConfig",
    "RopeConfig",
    "SparseMoeBlock",
    "WeightLoadError",
    "build_model",
    "grouped_gemm_reference",
    "model_config_from_hf",
    "moe_experts",
    "route_topk",
]
