"""``silu(gate) * up`` of a fused gate/up projection output, as the ``elastiserve::silu_and_mul`` op.

``gate_up[..., 2I]`` holds gate in its first half and up in its second (the layout of ``GatedMLP.gate_up_proj`` and
the stacked MoE experts). The rounding follows the unfused ``F.silu(gate) * up``: SiLU in fp32 rounded to the input
dtype, then the product rounded once more, so the fused kernel and the reference differ only in exp's last bit.

``elastiserve::silu_and_mul_quant`` writes the product as fast mode's fp8 GEMM takes it (per-token E4M3 rows and
their fp32 scales, ``fp8_activations.quantize_row``): one program holds a whole row, which is how the quantizer
reads rows of this length at decode sizes anyway (``quantizes_in_one_pass``: <= 128 rows of I = 14336); more rows than
that run the two kernels, whose bytes are the same.

Runs Triton when ``current_platform().kernel_backend == "triton"`` and the pure-torch ``*_ref`` otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from elastiserve.kernels.fp8_activations import (
    empty_fp8_rows,
    fp8_constants,
    quantize_per_token,
    quantize_per_token_ref,
    quantize_row,
    quantizes_in_one_pass,
    row_warps,
)
from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.kernels.rms_norm import ElementwiseShapeError
from elastiserve.platforms import current_platform

BLOCK = 1024  # columns per program: a batch-1 decode row of Llama-8B (I = 14336) still spreads over 14 SMs


@triton.jit
def _silu_mul(row_ptr, inter, cols, mask):
    """silu(gate) * up at ``cols`` of one gate_up row, in its dtype (masked lanes 0)."""
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0)
    up = tl.load(row_ptr + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded like F.silu's output
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)  # exact in fp32 for fp16/bf16: one rounding


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [R, I] contiguous
    gate_up_ptr,  # [R, 2I], last dim contiguous
    stride_row,
    inter,  # I
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    out = _silu_mul(gate_up_ptr + row * stride_row, inter, cols, mask)
    tl.store(out_ptr + row * inter + cols, out, mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(q_ptr, scale_ptr, gate_up_ptr, stride_row, inter, FP8_MAX: tl.constexpr,
                               MIN_NORMAL: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr, BLOCK: tl.constexpr,
                               PDL: tl.constexpr = False):
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # the whole row: the scale needs its maximum
    mask = cols < inter
    out = _silu_mul(gate_up_ptr + row * stride_row, inter, cols, mask)  # the fp16 row silu_and_mul writes
    q, scale = quantize_row(out.to(tl.float32), FP8_MAX, ROUND_IN_SOFTWARE, MIN_NORMAL)  # masked lanes are 0
    tl.store(scale_ptr + row, scale)
    tl.store(q_ptr + row * inter + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def _rows_of(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up as [R, 2I] rows with a unit last stride, a view where the leading dims allow it."""
    inter2 = gate_up.shape[-1]
    try:
        rows = gate_up.view(-1, inter2)
    except RuntimeError:  # leading dims that cannot share one stride
        rows = gate_up.contiguous().view(-1, inter2)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    rows = _rows_of(gate_up)
    grid = (rows.shape[0], triton.cdiv(inter, BLOCK))
    _silu_and_mul_kernel[grid](out, rows, rows.stride(0), inter, BLOCK=BLOCK, **pdl_options())
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


def _silu_and_mul_quant_triton(gate_up: torch.Tensor, fnuz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _rows_of(gate_up)
    num_rows, inter = rows.shape[0], rows.shape[1] // 2
    if not quantizes_in_one_pass(num_rows, inter):  # prefill-sized: the looping quantizer reads such rows faster
        return quantize_per_token(_silu_and_mul_triton(rows), fnuz)
    q, scale = empty_fp8_rows(num_rows, inter, fnuz, gate_up.device)
    if num_rows:
        block = triton.next_power_of_2(max(inter, 16))
        _silu_and_mul_quant_kernel[(num_rows,)](q, scale, rows, rows.stride(0), inter, **fp8_constants(fnuz),
                                                BLOCK=block, num_warps=row_warps(block), **pdl_options())
    return q, scale


@torch.library.custom_op("elastiserve::silu_and_mul_quant", mutates_args=())
def silu_and_mul_quant(gate_up: torch.Tensor, fnuz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token(silu_and_mul(gate_up).view(-1, I))``: (q fp8 [R, I], scale fp32 [R]) for fp16 rows."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ElementwiseShapeError(f"silu_and_mul_quant needs an even last dim, got {tuple(gate_up.shape)}")
    if gate_up.dtype != torch.float16:
        raise ElementwiseShapeError(f"silu_and_mul_quant takes fp16 rows, got {gate_up.dtype}")
    if current_platform().kernel_backend == "triton":
        return _silu_and_mul_quant_triton(gate_up, fnuz)
    return silu_and_mul_quant_ref(gate_up, fnuz)


@silu_and_mul_quant.register_fake
def _(gate_up, fnuz):
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    return empty_fp8_rows(rows, inter, fnuz, gate_up.device)


# ------------------------------------------------------------------------------------ pure-torch reference


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_quant_ref(gate_up: torch.Tensor, fnuz: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    out = silu_and_mul_ref(gate_up)
    return quantize_per_token_ref(out.reshape(-1, out.shape[-1]), fnuz)
