"""RMSNorm, alone and fused with the residual add before it, as ``elastiserve::`` custom ops.

Math, in HF's order so that fp16 outputs agree with transformers: normalise in fp32
(``x32 * rsqrt(mean(x32^2) + eps)``), round to the input dtype, THEN multiply by the weight. The fused op first adds
the residual in the input dtype (one rounding, as ``hidden + residual`` does) and returns that sum as well, so a
decoder layer reads and writes its residual stream once per norm instead of launching an add and ~8 norm ops.

The ``*_quant`` ops write the normalised fp16 row as fast mode's fp8 GEMM takes it, per-token E4M3 with its fp32
scale (``fp8_activations.quantize_row``), instead of the fp16 row: the same bytes as ``quantize_per_token`` on the
fp16 output, without its launch (2.0-3.0 us a GEMM at 2-16 rows of K = 4096 on the H200,
benchmarks/kernels/results/h200-fp8-decode-tiles-s17.json) or the fp16 row's write and read.

Every op runs Triton when ``current_platform().kernel_backend == "triton"`` and the pure-torch ``*_ref`` otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastiserve.kernels.fp8_activations import (
    empty_fp8_rows,
    fp8_constants,
    quantize_per_token_ref,
    quantize_row,
)
from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.platforms import current_platform
from elastiserve.platforms.errors import ElastiserveError


class ElementwiseShapeError(ElastiserveError, ValueError):
    """A tensor handed to a fused elementwise op (norm, rotary, SiLU-and-mul) has a shape or layout it cannot take."""


MAX_HIDDEN = 65536  # one program holds a whole row in registers; 8192 (Llama-70B) is the largest we serve


def _use_triton() -> bool:
    return current_platform().kernel_backend == "triton"


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [R, N] contiguous; written unless QUANT
    q_ptr,  # [R, N] fp8 and
    scale_ptr,  # [R] fp32: written with QUANT
    residual_out_ptr,  # [R, N] contiguous; written only with HAS_RESIDUAL
    x_ptr,  # rows of x: row r = (r // rows_inner, r % rows_inner), see _row_layout
    residual_ptr,  # same row layout as x (its own strides); read only with HAS_RESIDUAL
    weight_ptr,  # [N]
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    rows_inner,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    ROUND_IN_SOFTWARE: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    # Loading the weight before the wait (nothing writes it) was timed in session 27 (code at c184519): the fast
    # step 0-4 us shorter at batches 1-16, 3 us longer at 32 (h200-llama8b-decode-s27-norm-early.json): not kept.
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // rows_inner, row % rows_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    # Issued with x's load: ptxas keeps global loads below a barrier, so a weight load written after the mean's
    # block reduction waited a second memory latency there (the norm weights leave the L2 between decode steps).
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask, other=0.0)
        x = x + residual  # in the input dtype: the same single rounding as torch's ``x + residual``
        tl.store(residual_out_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.math.rsqrt(mean_square + eps)).to(x.dtype)  # HF rounds here, before the weight
    # An fp16 (or bf16) product is exact in fp32, so one rounding here equals the fp16 multiply torch does.
    out = (normed.to(tl.float32) * weight.to(tl.float32)).to(out_ptr.dtype.element_ty)
    if QUANT:  # the fp16 row quantized as quantize_per_token would read it back (masked lanes are 0)
        q, scale = quantize_row(out.to(tl.float32), FP8_MAX, ROUND_IN_SOFTWARE, MIN_NORMAL)
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * n_cols + cols, out, mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(t, stride_outer, stride_inner, rows_inner) addressing every row of ``t[..., N]`` without a copy where the
    leading dims allow it: one stride for collapsible dims, two for a 3-d view such as per-head q out of a qkv split."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t, 0, 0, 1
    try:
        rows = t.view(-1, t.shape[-1])
        return t, rows.stride(0), 0, 1
    except RuntimeError:
        pass
    if t.dim() != 3:
        t = t.contiguous()
        return t, t.shape[-1], 0, 1
    return t, t.stride(0), t.stride(1), t.shape[1]


def _num_warps(block: int, quant: bool = False) -> int:
    # The plain norm keeps each thread at ~32 fp16 elements of the row, the quantizing one at ~8 (its second block
    # reduction, for the scale, is cheaper spread thin). Fused add + norm of 4,096 columns at 1-4 rows on the H200
    # (session 22, benchmarks/kernels/results/h200-norm-warps-s22.json, 64 calls in a graph): plain 1.13-1.19 us at
    # 4 warps against 1.24-1.26 at 16; quantizing 1.77-1.84 us at 16 warps against 2.47-2.56 at 4.
    return max(1, min(block // (256 if quant else 1024), current_platform().max_num_warps))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            fp8_rows: tuple[torch.Tensor, torch.Tensor] | None = None, fnuz: bool = False):
    """(out, new residual); with ``fp8_rows`` (q, scale) those are written instead of ``out`` (left empty)."""
    has_residual = residual is not None
    quant = fp8_rows is not None
    out_shape = (0,) if quant else x.shape  # a quantizing launch writes no fp16 row
    out = torch.empty(out_shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if has_residual else out
    q, scale = fp8_rows if quant else (out, out)
    n_cols = x.shape[-1]
    num_rows = x.numel() // n_cols if n_cols else 0
    if num_rows == 0:
        return out, residual_out
    x, sxo, sxi, rows_inner = _row_layout(x)
    sro, sri = 0, 0
    if has_residual:
        residual, sro, sri, r_inner = _row_layout(residual)
        if r_inner != rows_inner:  # the two split their leading dims differently: give both the plain layout
            x, residual = x.contiguous(), residual.contiguous()
            sxo, sxi, sro, sri, rows_inner = n_cols, 0, n_cols, 0, 1
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(num_rows,)](
        out, q, scale, residual_out, x, residual if has_residual else x, weight.contiguous(),
        sxo, sxi, sro, sri, rows_inner, n_cols, eps,
        HAS_RESIDUAL=has_residual, QUANT=quant, **fp8_constants(fnuz), BLOCK=block, num_warps=_num_warps(block, quant),
        **pdl_options(),
    )  # fmt: skip
    return out, residual_out


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    hidden = x.shape[-1] if x.dim() else None
    if weight.shape != (hidden,):
        raise ElementwiseShapeError(f"rms_norm weight must be [{hidden}], got {tuple(weight.shape)} for x {x.shape}")
    if hidden > MAX_HIDDEN:
        raise ElementwiseShapeError(f"rms_norm rows of {hidden} exceed the {MAX_HIDDEN} one program holds")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ElementwiseShapeError(
            f"residual {residual.dtype} {tuple(residual.shape)} does not match x {x.dtype} {tuple(x.shape)}"
        )


@torch.library.custom_op("elastiserve::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x[..., N]`` over its last dim (any leading dims, any strides) times ``weight[N]``.

    Returns a contiguous tensor of ``x``'s shape in ``promote_types(x.dtype, weight.dtype)``.
    """
    _check(x, weight)
    if _use_triton():
        return _launch(x, None, weight, eps)[0]
    return rms_norm_ref(x, weight, eps).contiguous()


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("elastiserve::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual`` (in their dtype) and ``out = rms_norm(new_residual, weight, eps)``.

    Returns ``(out, new_residual)``, both contiguous with ``x``'s shape; neither input is modified.
    """
    _check(x, weight, residual)
    if _use_triton():
        return _launch(x, residual, weight, eps)
    out, new_residual = fused_add_rms_norm_ref(x, residual, weight, eps)
    return out.contiguous(), new_residual.contiguous()


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), x.new_empty(x.shape)


def _check_quant(x: torch.Tensor, weight: torch.Tensor) -> None:
    if torch.promote_types(x.dtype, weight.dtype) != torch.float16:
        raise ElementwiseShapeError(f"a quantizing norm takes fp16 rows, got x {x.dtype} and weight {weight.dtype}")


def _quantized_launch(x, residual, weight, eps, fnuz):
    rows = empty_fp8_rows(x.numel() // x.shape[-1], x.shape[-1], fnuz, x.device)
    _, new_residual = _launch(x, residual, weight, eps, rows, fnuz)
    return (*rows, new_residual)


@torch.library.custom_op("elastiserve::rms_norm_quant", mutates_args=())
def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, fnuz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token(rms_norm(x, weight, eps).view(-1, N))``: (q fp8 [R, N], scale fp32 [R]) for fp16 rows."""
    _check(x, weight)
    _check_quant(x, weight)
    if _use_triton():
        return _quantized_launch(x, None, weight, eps, fnuz)[:2]
    return rms_norm_quant_ref(x, weight, eps, fnuz)


@rms_norm_quant.register_fake
def _(x, weight, eps, fnuz):
    return empty_fp8_rows(x.numel() // x.shape[-1], x.shape[-1], fnuz, x.device)


@torch.library.custom_op("elastiserve::fused_add_rms_norm_quant", mutates_args=())
def fused_add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fnuz: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` with its output quantized per token: (q [R, N], scale [R], new_residual)."""
    _check(x, weight, residual)
    _check_quant(x, weight)
    if _use_triton():
        return _quantized_launch(x, residual, weight, eps, fnuz)
    q, scale, new_residual = fused_add_rms_norm_quant_ref(x, residual, weight, eps, fnuz)
    return q, scale, new_residual.contiguous()


@fused_add_rms_norm_quant.register_fake
def _(x, residual, weight, eps, fnuz):
    return (*empty_fp8_rows(x.numel() // x.shape[-1], x.shape[-1], fnuz, x.device), x.new_empty(x.shape))


# ------------------------------------------------------------------------------------ pure-torch references


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = residual + x
    return rms_norm_ref(new_residual, weight, eps), new_residual


def rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, fnuz: bool = False):
    out = rms_norm_ref(x, weight, eps)
    return quantize_per_token_ref(out.reshape(-1, out.shape[-1]), fnuz)


def fused_add_rms_norm_quant_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                 fnuz: bool = False):
    out, new_residual = fused_add_rms_norm_ref(x, residual, weight, eps)
    return (*quantize_per_token_ref(out.reshape(-1, out.shape[-1]), fnuz), new_residual)
