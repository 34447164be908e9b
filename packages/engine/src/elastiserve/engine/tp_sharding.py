"""Megatron-style sharding of a loaded ``CausalLM`` for tensor parallelism (``tp.py`` runs the ranks).

``qkv_proj`` and ``gate_up_proj`` are column-parallel (each rank keeps its heads / its
slice of the intermediate size, fused halves sharded separately), ``o_proj`` and ``down_proj`` are row-parallel and
followed by an all-reduce; MoE experts shard their intermediate dimension the same way and the block output is
all-reduced. Embeddings, norms, the router and ``lm_head`` stay replicated (a local matmul, so only rank 0 computes
the logits and samples). Each rank owns its KV pool and SUM shared region for its own heads and weight shards.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from elastiserve.engine.models.layers import Linear, takes_fp8_rows
from elastiserve.platforms import ConfigError

if TYPE_CHECKING:
    from elastiserve.engine.tp import TPGroup


class AllReduce(nn.Module):
    """Wraps a row-parallel module: each rank holds a partial sum, the all-reduce completes it (graph-capturable)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        out = self.inner(x, *args)
        dist.all_reduce(out)
        return out

    def takes_fp8_rows(self, rows: int) -> bool:
        """The wrapped layer's answer: its input (this rank's shard of the rows) passes through unchanged."""
        return takes_fp8_rows(self.inner, rows)


def _rows(weight: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """Concatenate this rank's slice of each fused segment (segment ``i`` has ``sizes[i]`` rows)."""
    parts, start = [], 0
    for size in sizes:
        if size % world:
            raise ConfigError(f"a fused segment of {size} rows does not split over {world} ranks")
        shard = size // world
        parts.append(weight[start + rank * shard : start + (rank + 1) * shard])
        start += size
    return torch.cat(parts)


def _linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                       dtype=weight.dtype)  # fmt: skip
    linear.weight.data.copy_(weight)
    if bias is not None:
        linear.bias.data.copy_(bias)
    return linear.requires_grad_(False)


def shard_model(model: nn.Module, group: TPGroup) -> None:
    """Shard a loaded (not yet nested) ``CausalLM`` in place for ``group``; the runner nests the shards after."""
    rank, world = group.rank, group.world_size
    config = model.config
    if config.num_attention_heads % world or config.num_key_value_heads % world:
        raise ConfigError(f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads do not "
                          f"split over tensor_parallel_size={world}")  # fmt: skip
    for layer in model.decoder_layers:
        attn = layer.self_attn
        qkv = attn.qkv_proj
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        bias = _rows(qkv.bias, sizes, rank, world) if qkv.bias is not None else None
        attn.qkv_proj = _linear_from(_rows(qkv.weight, sizes, rank, world), bias)
        attn.num_heads //= world
        attn.num_kv_heads //= world
        attn.q_size //= world
        attn.kv_size //= world
        o = attn.o_proj
        attn.o_proj = AllReduce(_linear_from(o.weight[:, rank * attn.q_size : (rank + 1) * attn.q_size], None))
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj"):
            inter = mlp.down_proj.in_features
            mlp.gate_up_proj = _linear_from(_rows(mlp.gate_up_proj.weight, [inter, inter], rank, world), None)
            shard = inter // world
            mlp.down_proj = AllReduce(_linear_from(mlp.down_proj.weight[:, rank * shard : (rank + 1) * shard], None))
        else:
            _shard_experts(layer, mlp, rank, world)
    # The KV pool is sized from the model config: each rank stores only its KV heads.
    model.config = dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world,
                                       num_key_value_heads=config.num_key_value_heads // world)  # fmt: skip


def _shard_experts(layer: nn.Module, moe: nn.Module, rank: int, world: int) -> None:
    inter = moe.w_down.shape[2]
    if inter % world:
        raise ConfigError(f"expert intermediate size {inter} does not split over {world} ranks")
    shard = inter // world
    gate_up = moe.w_gate_up.data
    gate = gate_up[:, rank * shard : (rank + 1) * shard]
    up = gate_up[:, inter + rank * shard : inter + (rank + 1) * shard]
    moe.w_gate_up = nn.Parameter(torch.cat([gate, up], dim=1).contiguous(), requires_grad=False)
    moe.w_down = nn.Parameter(moe.w_down.data[:, :, rank * shard : (rank + 1) * shard].contiguous(),
                              requires_grad=False)  # fmt: skip
    layer.mlp = AllReduce(moe)
