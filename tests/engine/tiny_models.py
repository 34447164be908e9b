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


def small_llama_config(num_layers: int, max_positions: int) -> transformers.LlamaConfig:
    """The graph and padding tests' model: 97 tokens, 64 wide, GQA 4 / 2 heads of 16."""
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=64, intermediate_size=96,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
    )  # fmt: skip


def small_moe_config(num_layers: int, max_positions: int) -> transformers.Qwen3MoeConfig:
    """``small_llama_config``'s shapes as a Qwen3-MoE: 8 experts of 32, top 2, every layer sparse."""
    return transformers.Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=97, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
    )  # fmt: skip


def random_moe_block(hidden: int, intermediate: int, seed: int, device: str = "cpu"):
    """A fp16 ``SparseMoeBlock`` of 8 experts, top 2, with seeded random weights of standard deviation 0.2."""
    import torch

    from elastiserve.engine.models import SparseMoeBlock

    torch.manual_seed(seed)
    block = SparseMoeBlock(hidden, intermediate, num_experts=8, top_k=2, renormalize=True)
    block = block.to(device=device, dtype=torch.float16)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.2)
    return block


def random_fp16_model(config: transformers.PretrainedConfig, device: str = "cpu", scale: float = 0.05):
    """An engine model of ``config`` with seeded random fp16 weights of standard deviation ``scale``."""
    import torch

    from elastiserve.engine.models import build_model

    model = build_model(config.to_dict(), dtype=torch.float16, device=device)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config)  # only its tensor names and shapes
    model.load_weights((n, (torch.randn_like(t, dtype=torch.float32) * scale).half())
                       for n, t in reference.state_dict().items())
    return model
