"""One decoder-only transformer covering Llama 3.x / SmolLM2, Qwen3, Qwen3-MoE and Mixtral.

The four differ only in: per-head q/k RMSNorm (Qwen3), MoE instead of the dense MLP (Qwen3-MoE, Mixtral), rope
scaling (Llama 3.1), tied embeddings (SmolLM2). ``load_weights`` maps HF checkpoint names onto the fused layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from elastiserve.engine.models.config import ModelConfig
from elastiserve.engine.models.layers import (
    Attention,
    AttentionContext,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    takes_fp8_rows,
)
from elastiserve.engine.models.moe import SparseMoeBlock, padding_rows_of
from elastiserve.platforms import ElastiserveError


class WeightLoadError(ElastiserveError, ValueError):
    """A checkpoint that does not fit the model: unknown or missing tensors, or wrong shapes."""


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = layer_idx in config.moe_layers
        if self.is_moe:
            self.mlp: nn.Module = SparseMoeBlock(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
            )
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        ctx: AttentionContext,
        padding_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before adding it). Each residual add is fused into the norm that follows it,
        so ``hidden`` is the previous layer's MLP output still to be added (the embeddings, with ``residual`` None,
        for the first layer). Row-parallel outputs are all-reduced inside ``self_attn`` / ``mlp``, before any add."""
        rows = hidden.shape[0]
        fp8 = takes_fp8_rows(self.self_attn.qkv_proj, rows)  # fast mode's fp8 GEMM: the norm quantizes for it
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden, fp8=fp8)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual, fp8=fp8)
        hidden = self.self_attn(hidden, positions, rotary, ctx)
        fp8 = not self.is_moe and takes_fp8_rows(self.mlp.gate_up_proj, rows)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual, fp8=fp8)
        if self.is_moe:  # padding rows of a padded step route to no expert
            return self.mlp(hidden, padding_rows), residual
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    """Flat-token decoder: ``forward(input_ids[T], positions[T], ctx) -> hidden[T, H]``.

    Tokens of all sequences in a step are concatenated; ``ctx.attend`` knows where each sequence starts.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.decoder_layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        padding_rows = padding_rows_of(ctx.valid_tokens(), input_ids.shape[0]) if self.config.moe_layers else None
        for layer in self.decoder_layers:
            hidden, residual = layer(hidden, residual, positions, self.rotary, ctx, padding_rows)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.forward_with_residual(hidden, residual)[0]  # the last layer's MLP add, fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden[B, H] (the rows to sample from) -> logits[B, V] in fp32."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters; raise WeightLoadError on unknown, missing or misfit ones."""
        params = dict(self.named_parameters(remove_duplicate=False))
        filled: dict[str, int] = {}
        for hf_name, tensor in weights:
            for target, rows in hf_to_targets(hf_name, self.config):
                if target not in params:
                    raise WeightLoadError(f"checkpoint tensor {hf_name!r} maps to unknown parameter {target!r}")
                _copy_rows(params[target], rows, tensor, hf_name)
                filled[target] = filled.get(target, 0) + tensor.numel()
        _check_complete(params, filled, self.config)


class _ExpertRows(NamedTuple):
    """Rows of one expert inside a stacked [E, N, K] parameter."""

    expert: int
    rows: slice


# Checkpoint names -> (our parameter, which rows of it): None is the whole tensor.
_EXPERT = re.compile(r"^layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_SHARDED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def hf_to_targets(hf_name: str, config: ModelConfig) -> list[tuple[str, slice | _ExpertRows | None]]:
    name = hf_name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq"):
        return []  # recomputed from the config
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return []  # tied to embed_tokens
    if match := _EXPERT.match(name):
        return [_expert_target(int(match[1]), int(match[2]), match[3], config)]
    if match := _FUSED_EXPERTS.match(name):  # transformers 5 in-memory names: already stacked
        return [(f"decoder_layers.{match[1]}.mlp.w_{match[2].removesuffix('_proj')}", None)]
    name = re.sub(r"^layers\.", "decoder_layers.", name).replace("block_sparse_moe.gate.", "mlp.gate.")
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _SHARDED:
        fused, shard = _SHARDED[parts[-2]]
        return [(".".join([*parts[:-2], fused, parts[-1]]), _shard_rows(fused, shard, config))]
    return [(name, None)]


def _shard_rows(fused: str, shard: int, config: ModelConfig) -> slice:
    if fused == "qkv_proj":
        starts = (0, config.q_size, config.q_size + config.kv_size, config.q_size + 2 * config.kv_size)
        return slice(starts[shard], starts[shard + 1])
    size = config.intermediate_size
    return slice(shard * size, (shard + 1) * size)


def _expert_target(layer: int, expert: int, proj: str, config: ModelConfig) -> tuple[str, _ExpertRows]:
    # Qwen3-MoE: gate_proj/up_proj/down_proj; Mixtral: w1 (gate), w3 (up), w2 (down).
    size = config.moe_intermediate_size
    prefix = f"decoder_layers.{layer}.mlp."
    rows = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}
    if proj in rows:
        return prefix + "w_gate_up", _ExpertRows(expert, slice(rows[proj] * size, (rows[proj] + 1) * size))
    if proj in ("down_proj", "w2"):
        return prefix + "w_down", _ExpertRows(expert, slice(None))
    raise WeightLoadError(f"unknown expert projection {proj!r} in layer {layer}")


def _copy_rows(param: torch.Tensor, rows: slice | _ExpertRows | None, tensor: torch.Tensor, hf_name: str) -> None:
    if isinstance(rows, _ExpertRows):
        dest = param.data[rows.expert][rows.rows]
    elif rows is None:
        dest = param.data
    else:
        dest = param.data[rows]
    if dest.shape != tensor.shape:
        raise WeightLoadError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}")
    dest.copy_(tensor)


def _check_complete(params: dict[str, torch.Tensor], filled: dict[str, int], config: ModelConfig) -> None:
    # Every element exactly once: a fused parameter counts as loaded only when all of its shards arrived.
    wrong = [
        f"{name} ({filled.get(name, 0)} of {param.numel()} elements)"
        for name, param in params.items()
        if filled.get(name, 0) != param.numel() and not (name == "lm_head.weight" and config.tie_word_embeddings)
    ]
    if wrong:
        raise WeightLoadError(f"checkpoint does not fill {len(wrong)} parameters exactly once, e.g. {wrong[:4]}")
