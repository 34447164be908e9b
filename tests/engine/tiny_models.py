"""Tiny random model configs shared by the engine tests (several layers and KV heads, so pairs, per-layer modes and
tensor-parallel head splits all have something to act on)."""

from __future__ import annotations

import transformers


def tiny_llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        initializer_range=0.15, tie_word_embeddings=False,
    )  # fmt: skip
