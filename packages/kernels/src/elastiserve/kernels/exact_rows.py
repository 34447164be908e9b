"""Exact outputs of a nested layer at a few picked weight rows: the step behind a head's exact top logits.

A nested lm_head in fast mode reads the upper plane only; with ``NestedLinear.exact_top`` = N it then recomputes each
token's N largest logits from the exact fp16 weight rows. In plain torch ops that step was a gather of both planes'
rows, the plane merge (several elementwise kernels), two widenings, a batched dot and the rounding: about a dozen
short launches, which cost 3.4-4.9 % of the Llama-3.1-8B fast decode step at batches 1-32 on an H100 beside the FP8
head without exact logits (BENCHMARKS.md, engine, session 39; the top-k and the scatter included). This kernel does
the gather, the merge, the fp32 dot, the scale and the bias in one launch: one program a token and a block of picked
rows, the K loop reading the picked rows of both planes (N = 16 over K = 4,096 is 128 KB a token).

Registered op: ``elastiserve::exact_rows(x, picked, upper, lower, bias, nesting, weight_exp) -> [R, T] x.dtype``;
reference: ``exact_rows_reference`` (the same arithmetic in torch ops; fp32 sums in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastiserve.kernels import formats
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.kernels.weight_decode import decode_weight_tile
from elastiserve.platforms import ConfigError, current_platform

BLOCK_K = 256
BLOCK_T = 16


@triton.jit
def _exact_rows_kernel(x_ptr, picked_ptr, upper_ptr, lower_ptr, bias_ptr, out_ptr, num_picked, k, scale,
                       stride_xr, stride_pr, stride_un, stride_ln, stride_or,
                       HAS_BIAS: tl.constexpr, NESTING: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr = False):
    wait_for_prior_grid(PDL)
    row = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_picked
    rows = tl.load(picked_ptr + row * stride_pr + offs_t, mask=t_mask, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x = tl.load(x_ptr + row * stride_xr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        mask = t_mask[:, None] & k_mask[None, :]
        u = tl.load(upper_ptr + rows[:, None] * stride_un + offs_k[None, :], mask=mask, other=0)
        low = tl.load(lower_ptr + rows[:, None] * stride_ln + offs_k[None, :], mask=mask, other=0)
        w = decode_weight_tile(u, low, 0, NESTING, False)  # the exact fp16 weight (of w * 2^-weight_exp)
        acc += w.to(tl.float32) * x[None, :]
    exact = tl.sum(acc, axis=1) * scale  # a power of two: exact
    if HAS_BIAS:
        exact += tl.load(bias_ptr + rows, mask=t_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_or + offs_t, exact.to(out_ptr.dtype.element_ty), mask=t_mask)


def exact_rows_reference(x: torch.Tensor, picked: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                         bias: torch.Tensor | None, nesting: int, weight_exp: int) -> torch.Tensor:
    """``out[r, t] = x[r] . W[picked[r, t]] + b[picked[r, t]]`` with W merged exactly from both planes, summed in
    fp32 and rounded to ``x.dtype`` (as full mode's GEMM rounds)."""
    weight = formats.merge(upper[picked], lower[picked], Nesting(nesting), weight_exp)  # [R, T, K] fp16
    exact = torch.matmul(weight.float(), x.float().unsqueeze(-1)).squeeze(-1)  # [R, T] fp32
    if bias is not None:
        exact = exact + bias[picked].float()  # the picked entries only, not the whole vocabulary's bias
    return exact.to(x.dtype)


def _check(x: torch.Tensor, picked: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
           bias: torch.Tensor | None, nesting: int) -> None:
    if x.dim() != 2 or picked.dim() != 2 or picked.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [R, K] and picked [R, T], got {tuple(x.shape)} and {tuple(picked.shape)}")
    if upper.dtype != torch.uint8 or lower.dtype != torch.uint8 or upper.shape != lower.shape:
        raise ValueError("upper and lower must be uint8 planes of one shape")
    if upper.dim() != 2 or upper.shape[1] != x.shape[1]:
        raise ValueError(f"planes must be [N, {x.shape[1]}], got {tuple(upper.shape)}")
    if picked.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"picked must hold int32 or int64 row indices, got {picked.dtype}")
    if bias is not None and bias.shape != (upper.shape[0],):
        raise ValueError(f"bias must be [{upper.shape[0]}], got {tuple(bias.shape)}")
    if nesting not in (Nesting.E4M3, Nesting.E5M2):
        raise ValueError(f"nesting must be E4M3 or E5M2, got {nesting}")


def exact_rows(x: torch.Tensor, picked: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
               bias: torch.Tensor | None, nesting: int, weight_exp: int = 0, *, block_t: int | None = None,
               block_k: int | None = None) -> torch.Tensor:
    """[R, T] in ``x.dtype``: each row of ``x`` against the exact weight rows it picked (see the reference).
    ``block_t`` / ``block_k``: picked rows a program and its K tile (powers of two; defaults ``BLOCK_T`` /
    ``BLOCK_K``); another K tile sums in another order (one fp16 rounding apart at most)."""
    _check(x, picked, upper, lower, bias, nesting)
    for name, tile in (("block_t", block_t), ("block_k", block_k)):  # tl.arange takes powers of two only
        if tile is not None and (tile < 1 or tile & (tile - 1)):
            raise ConfigError(f"exact_rows: {name} must be a power of two, got {tile}")
    unit_stride = x.stride(1) == 1 and picked.stride(1) == 1 and upper.stride(1) == 1 and lower.stride(1) == 1
    if not unit_stride or current_platform().kernel_backend == "reference":
        return exact_rows_reference(x, picked, upper, lower, bias, nesting, weight_exp)
    rows, num_picked = picked.shape
    out = torch.empty((rows, num_picked), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_t = min(block_t or BLOCK_T, triton.next_power_of_2(num_picked))
    grid = (rows, triton.cdiv(num_picked, block_t))
    _exact_rows_kernel[grid](
        x, picked, upper, lower, bias if bias is not None else x, out, num_picked, x.shape[1],
        2.0 ** formats.check_weight_exp(weight_exp),
        x.stride(0), picked.stride(0), upper.stride(0), lower.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, NESTING=int(nesting), BLOCK_T=block_t, BLOCK_K=block_k or BLOCK_K, num_warps=4,
        **pdl_options())
    return out


@torch.library.custom_op("elastiserve::exact_rows", mutates_args=())
def exact_rows_op(x: torch.Tensor, picked: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                  bias: torch.Tensor | None, nesting: int, weight_exp: int) -> torch.Tensor:
    return exact_rows(x, picked, upper, lower, bias, nesting, weight_exp)


@exact_rows_op.register_fake
def _(x, picked, upper, lower, bias, nesting, weight_exp):
    return x.new_empty(picked.shape)
