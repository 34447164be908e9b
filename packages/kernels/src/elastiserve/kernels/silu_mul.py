"""``silu(gate) * up`` of a fused gate/up projection output, as the ``elastiserve::silu_and_mul`` op.

``gate_up[..., 2I]`` holds gate in its first half and up in its second (the layout of ``GatedMLP.gate_up_proj`` and
the stacked MoE experts). The rounding follows the unfused ``F.silu(gate) * up``: SiLU in fp32 rounded to the input
dtype, then the product rounded once more, so the fused kernel and the reference differ only in exp's last bit.

Runs Triton when ``current_platform().kernel_backend == "triton"`` and the pure-torch ``*_ref`` otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from elastiserve.kernels.rms_norm import ElementwiseShapeError
from elastiserve.platforms import current_platform

BLOCK = 1024  # columns per program: a batch-1 decode row of Llama-8B (I = 14336) still spreads over 14 SMs


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [R, I] contiguous
    gate_up_ptr,  # [R, 2I], last dim contiguous
    stride_row,
    inter,  # I
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_row + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded like F.silu's output
    out = silu.to(tl.float32) * up.to(tl.float32)  # exact in fp32 for fp16/bf16 inputs: one rounding below
    tl.store(out_ptr + row * inter + cols, out.to(gate.dtype), mask=mask)


def _silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    try:
        rows = gate_up.view(-1, 2 * inter)
    except RuntimeError:  # leading dims that cannot share one stride
        rows = gate_up.contiguous().view(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    grid = (rows.shape[0], triton.cdiv(inter, BLOCK))
    _silu_and_mul_kernel[grid](out, rows, rows.stride(0), inter, BLOCK=BLOCK)
    return out


@torch.library.custom_op("elastiserve::silu_and_mul", mutates_args=())
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]`` for ``gate_up[..., 2I]``; returns contiguous ``[..., I]``."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ElementwiseShapeError(f"silu_and_mul needs an even last dim, got {tuple(gate_up.shape)}")
    if current_platform().kernel_backend == "triton":
        return _silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up).contiguous()


@silu_and_mul.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


# ------------------------------------------------------------------------------------ pure-torch reference


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
