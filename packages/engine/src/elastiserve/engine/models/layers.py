"""Building blocks shared by every decoder: RMSNorm, rotary embedding, GQA attention, SiLU-gated MLP.

The elementwise work (norms, residual adds, rotary, SiLU-and-mul) runs as fused ``elastiserve::`` ops on a GPU, one
kernel each where the unfused torch code launched 42 per layer; on the CPU their pure-torch references run, which
compute exactly what the unfused code did. The rotary is the attention context's to apply
(``AttentionContext.attend_rotary``): the paged context fuses it with the KV-cache write.

In fast mode the norms before qkv and gate_up and the SiLU-and-mul before down quantize their output for the fp8
GEMM that follows (``Fp8Rows``) when that layer says it runs fp8 at this row count (``NestedLinear.takes_fp8_rows``):
the same bytes the GEMM's own quantizer would write, one launch fewer per GEMM.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Protocol

import torch
from torch import nn

from elastiserve.engine.models.config import ModelConfig, RopeConfig
from elastiserve.kernels import skinny_gemm  # noqa: F401  (registers elastiserve::skinny_linear)
from elastiserve.kernels.fp8_activations import Fp8Rows, platform_fnuz
from elastiserve.kernels.rms_norm import (
    fused_add_rms_norm_quant_ref,
    fused_add_rms_norm_ref,
    rms_norm_quant_ref,
    rms_norm_ref,
)
from elastiserve.kernels.rotary import rotary_embedding_ref
from elastiserve.kernels.silu_mul import silu_and_mul_quant_ref, silu_and_mul_ref
from elastiserve.kernels.skinny_configs import SKINNY_MAX_ROWS

# As attention_context.kernel_ops: Triton on the CPU is only interpreted (for the kernel tests), so the CPU gets the
# references directly rather than through the ops.
REFERENCE_OPS = SimpleNamespace(
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    rotary_embedding=rotary_embedding_ref,
    silu_and_mul=silu_and_mul_ref,
    rms_norm_quant=rms_norm_quant_ref,
    fused_add_rms_norm_quant=fused_add_rms_norm_quant_ref,
    silu_and_mul_quant=silu_and_mul_quant_ref,
)
FUSED_OPS = SimpleNamespace(
    rms_norm=torch.ops.elastiserve.rms_norm,
    fused_add_rms_norm=torch.ops.elastiserve.fused_add_rms_norm,
    rotary_embedding=torch.ops.elastiserve.rotary_embedding,
    silu_and_mul=torch.ops.elastiserve.silu_and_mul,
    rms_norm_quant=torch.ops.elastiserve.rms_norm_quant,
    fused_add_rms_norm_quant=torch.ops.elastiserve.fused_add_rms_norm_quant,
    silu_and_mul_quant=torch.ops.elastiserve.silu_and_mul_quant,
)


def elementwise_ops(device: torch.device) -> SimpleNamespace:
    """rms_norm / fused_add_rms_norm / rotary_embedding / silu_and_mul for tensors on ``device``."""
    return REFERENCE_OPS if device.type == "cpu" else FUSED_OPS


def takes_fp8_rows(linear: nn.Module, rows: int) -> bool:
    """Whether ``linear`` (a ``NestedLinear``, or a wrapper that passes its input through) runs fp8 on ``rows`` rows
    and so takes ``Fp8Rows``; plain linears never do."""
    takes = getattr(linear, "takes_fp8_rows", None)
    return takes is not None and takes(rows)


class AttentionContext(Protocol):
    """What a model needs from the runner: attention over this step's tokens plus whatever KV is cached.

    ``attend_rotary`` gets q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D] before the rotary embedding (views of the qkv
    output are fine), the tokens' positions[T] and the model's ``RotaryEmbedding``; it rotates q and k (the paged
    context in the same launch that caches k and v) and returns [T, Hq, D]. The softmax scale is ``D ** -0.5`` for
    every supported model.
    """

    def attend_rotary(
        self,
        layer_idx: int,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor: ...

    def valid_tokens(self) -> torch.Tensor | None:
        """[1] int tensor: how many leading rows are real tokens, when the step is padded (a CUDA graph's
        bucket); None when every row is."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
        """Normalise in fp32, cast back before the weight multiply (the order HF uses, so fp16 outputs agree);
        ``fp8``: the fp16 rows quantized per token for an fp8 GEMM."""
        if fp8:
            return Fp8Rows(*elementwise_ops(x.device).rms_norm_quant(x, self.weight, self.eps, platform_fnuz()))
        return elementwise_ops(x.device).rms_norm(x, self.weight, self.eps)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor,
                              fp8: bool = False) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add before a norm, fused into it."""
        ops = elementwise_ops(x.device)
        if fp8:
            q, scale, new_residual = ops.fused_add_rms_norm_quant(x, residual, self.weight, self.eps, platform_fnuz())
            return Fp8Rows(q, scale), new_residual
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    interpolated = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, interpolated, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a cos/sin table for every position, kept in fp32."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_table", angles.cos(), persistent=False)
        self.register_buffer("sin_table", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D] (views of the qkv output are fine), positions: [T]
        return elementwise_ops(q.device).rotary_embedding(positions, q, k, self.cos_table, self.sin_table)


class Linear(nn.Linear):
    """``nn.Linear`` whose fp16 GPU forward at decode row counts goes through ``elastiserve::skinny_linear``: the
    skinny (GEMV-style) kernel where the platform's table routes those sizes, torch's GEMM otherwise. Longer inputs
    (prefill) call torch directly, without the op's dispatch cost."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        decode_rows = x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS
        if x.is_cuda and decode_rows and x.dtype == self.weight.dtype == torch.float16:
            return torch.ops.elastiserve.skinny_linear(x, self.weight, self.bias)
        return super().forward(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # hidden: or Fp8Rows
        tokens = q.shape[0]
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = ctx.attend_rotary(self.layer_idx, positions, q, k, v, rotary)
        return self.o_proj(out.reshape(tokens, self.q_size))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one linear (gate rows first)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(silu_and_mul(gate_up, fp8=takes_fp8_rows(self.down_proj, gate_up.shape[0])))


def silu_and_mul(gate_up: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
    """silu(gate) * up for gate_up[..., 2I] (gate first) -> [..., I]; ``fp8``: rows quantized per token."""
    if fp8:
        return Fp8Rows(*elementwise_ops(gate_up.device).silu_and_mul_quant(gate_up, platform_fnuz()))
    return elementwise_ops(gate_up.device).silu_and_mul(gate_up)
