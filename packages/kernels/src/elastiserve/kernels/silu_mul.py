"""``silu(gate) * up`` of a fused gate/up projection output, as the ``elastiserve::silu_and_mul`` op.

``gate_up[..., 2I]`` holds gate in its first half and up in its second (the layout of ``GatedMLP.gate_up_proj`` and
the stacked MoE experts). The rounding follows the unfused ``F.silu(gate) * up``: SiLU in fp32 rounded to the input
dtype, then the product rounded once more, so the fused kernel and the reference differ only in exp's last bit.

``elastiserve::silu_and_mul_quant`` writes the product as fast mode's fp8 GEMM takes it (per-token E4M3 rows and
their fp32 scales, ``fp8_activations.quantize_row``): one program holds a whole row, which is how the quantizer
reads rows of this length at decode sizes anyway (``quantizes_in_one_pass``: <= 128 rows of I = 14336); more rows than
that run the two kernels, whose bytes are the same. A few long rows (``SPLIT_QUANT_MAX_ROWS``) are instead spread over
BLOCK-wide programs in two launches: the products with each chunk's max, then the row scale from those maxima and the
codes. Every route writes the bytes ``quantize_per_token`` writes from ``silu_and_mul``'s output.

Runs Triton when ``current_platform().kernel_backend == "triton"`` and the pure-torch ``*_ref`` otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from elastiserve.kernels.fp8_activations import (
    QUANT_SHORT_K,
    SPLIT_BLOCK,
    empty_fp8_rows,
    fp8_constants,
    quantize_chunks,
    quantize_per_token,
    quantize_per_token_ref,
    quantize_row,
    quantizes_in_one_pass,
    row_warps,
)
from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.kernels.rms_norm import ElementwiseShapeError
from elastiserve.platforms import current_platform

# Columns per program: a batch-1 decode row of Llama-8B (I = 14336) still spreads over 14 SMs; the split quantizing
# route's chunks are the quantizer's (quantize_chunks reads these chunk maxima).
BLOCK = SPLIT_BLOCK
# Up to this many rows of more than QUANT_SHORT_K values, silu_and_mul_quant splits each row over BLOCK-wide programs
# in two launches (products and chunk maxima, then the scale and the fp8 codes) instead of one program a row: that
# program computes a whole 14,336-wide row on one SM and took 5.4 us a call on the H200 at 1-4 rows (session 19
# profile, PDL off) against 1.5 us for the plain SiLU-and-mul over 14 programs. An arch not listed keeps one program.
# The interpreter takes the split from the first row so the CPU tests reach it.
# Both launches as one, whose programs wait for their row's maximum, was timed in session 27 (code at c184519,
# benchmarks/engine/results/h200-llama8b-decode-s27-*.json, side by side): the fast step 1-12 us shorter at batches
# 1-16 (2.722 -> 2.714 ms at batch 2), 4 us longer at 32, less than one tree moves between runs: removed.
SPLIT_QUANT_MAX_ROWS = {"sm90": 32, "cpu": 4}


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


@triton.jit
def _silu_mul_chunk_max_kernel(out_ptr, chunk_max_ptr, gate_up_ptr, stride_row, inter, BLOCK: tl.constexpr,
                               PDL: tl.constexpr = False):
    """The first launch of the split quantizing SiLU-and-mul: one BLOCK-wide chunk of a row's fp16 product, and the
    chunk's max |value| into chunk_max[row, chunk]."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    out = _silu_mul(gate_up_ptr + row * stride_row, inter, cols, mask)
    tl.store(out_ptr + row * inter + cols, out, mask=mask)
    tl.store(chunk_max_ptr + row * tl.num_programs(1) + chunk, tl.max(tl.abs(out.to(tl.float32)), axis=0))


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


def splits_quantizing_rows(num_rows: int, inter: int) -> bool:
    """Whether silu_and_mul_quant spreads each of ``num_rows`` rows over programs (``SPLIT_QUANT_MAX_ROWS``)."""
    return inter > QUANT_SHORT_K and num_rows <= SPLIT_QUANT_MAX_ROWS.get(current_platform().arch, 0)


def _silu_and_mul_quant_triton(gate_up: torch.Tensor, fnuz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _rows_of(gate_up)
    num_rows, inter = rows.shape[0], rows.shape[1] // 2
    if not quantizes_in_one_pass(num_rows, inter):  # prefill-sized: the looping quantizer reads such rows faster
        return quantize_per_token(_silu_and_mul_triton(rows), fnuz)
    q, scale = empty_fp8_rows(num_rows, inter, fnuz, gate_up.device)
    if num_rows and splits_quantizing_rows(num_rows, inter):
        chunks = triton.cdiv(inter, BLOCK)
        product = torch.empty((num_rows, inter), dtype=rows.dtype, device=rows.device)
        chunk_max = torch.empty((num_rows, chunks), dtype=torch.float32, device=rows.device)
        grid = (num_rows, chunks)
        _silu_mul_chunk_max_kernel[grid](product, chunk_max, rows, rows.stride(0), inter, BLOCK=BLOCK, **pdl_options())
        quantize_chunks(product, chunk_max, q, scale, fnuz)
    elif num_rows:
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
