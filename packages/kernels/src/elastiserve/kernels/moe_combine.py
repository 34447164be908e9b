"""The MoE combine ``out[t] = sum_j weight[t, j] * expert_out[row_of[t, j]]`` as the ``elastiserve::moe_combine`` op.

``expert_out[R, H]`` holds the grouped GEMM's rows sorted by expert (R = T * top_k); ``row_of[T, k]`` says where
token t's j-th expert row landed (the inverse of the sort). One program per (token, column block) reads its k rows,
weights them in fp32 and sums them in j order, then writes one rounding in the output dtype. It replaces the fp32
route ``index_add_(expert_out.float() * weight[order])``: at R rows of H columns that writes and re-reads an fp32
copy of ``expert_out`` (two bytes in, eight bytes through memory per element, and R * H float atomics) where this
reads the fp16 rows once; and its sum order is fixed, where atomics sum in whatever order the rows arrive. (A GPU
compiler fuses each multiply-add into one FMA, so there the sum can differ from the reference's in the last fp32 bit.)
Padding rows of a padded step (``padding_rows[T]`` True) come out zero without reading their rows, which no expert
wrote.

Runs Triton when ``current_platform().kernel_backend == "triton"`` and the pure-torch ``moe_combine_ref`` otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.kernels.rms_norm import ElementwiseShapeError
from elastiserve.platforms import current_platform

BLOCK = 1024  # columns per program: Qwen3-30B-A3B's H = 2048 is two programs per token


@triton.jit
def _moe_combine_kernel(
    out_ptr,  # [T, H] contiguous
    expert_out_ptr,  # [R, H], last dim contiguous
    row_of_ptr,  # [T, TOP_K] int64 contiguous
    weight_ptr,  # [T, TOP_K] contiguous (any float dtype)
    padding_ptr,  # [T] bool; read only with HAS_PADDING
    stride_row,
    hidden,
    TOP_K: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    live = True
    if HAS_PADDING:
        live = tl.load(padding_ptr + token) == 0
    if live:
        for j in tl.static_range(TOP_K):
            row = tl.load(row_of_ptr + token * TOP_K + j)
            w = tl.load(weight_ptr + token * TOP_K + j).to(tl.float32)
            x = tl.load(expert_out_ptr + row * stride_row + cols, mask=mask, other=0.0)
            acc += x.to(tl.float32) * w
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(expert_out: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor,
           padding_rows: torch.Tensor | None) -> None:
    if expert_out.dim() != 2 or row_of.dim() != 2 or weights.shape != row_of.shape:
        raise ElementwiseShapeError(f"moe_combine needs expert_out [R, H], row_of and weights [T, k]; got "
                                    f"{tuple(expert_out.shape)}, {tuple(row_of.shape)}, {tuple(weights.shape)}")
    if row_of.dtype != torch.int64:
        raise ElementwiseShapeError(f"moe_combine's row_of must be int64, got {row_of.dtype}")
    if row_of.numel() > expert_out.shape[0]:
        raise ElementwiseShapeError(f"moe_combine: {row_of.numel()} token rows but expert_out has "
                                    f"{expert_out.shape[0]}")
    if padding_rows is not None and (padding_rows.shape != row_of.shape[:1] or padding_rows.dtype != torch.bool):
        raise ElementwiseShapeError(f"moe_combine's padding_rows must be bool [{row_of.shape[0]}], got "
                                    f"{tuple(padding_rows.shape)} {padding_rows.dtype}")


def _moe_combine_triton(expert_out, row_of, weights, padding_rows):
    tokens, top_k = row_of.shape
    hidden = expert_out.shape[1]
    out = torch.empty((tokens, hidden), dtype=expert_out.dtype, device=expert_out.device)
    if out.numel() == 0:
        return out
    if expert_out.stride(-1) != 1:
        expert_out = expert_out.contiguous()
    row_of, weights = row_of.contiguous(), weights.contiguous()
    has_padding = padding_rows is not None
    grid = (tokens, triton.cdiv(hidden, BLOCK))
    _moe_combine_kernel[grid](
        out, expert_out, row_of, weights, padding_rows.view(torch.uint8) if has_padding else row_of,
        expert_out.stride(0), hidden, TOP_K=top_k, HAS_PADDING=has_padding, BLOCK=BLOCK, **pdl_options()
    )  # fmt: skip
    return out


@torch.library.custom_op("elastiserve::moe_combine", mutates_args=())
def moe_combine(expert_out: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor,
                padding_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * expert_out[row_of[t, j]]`` (fp32 sum, j order), zero on padding rows;
    ``[T, H]`` in ``expert_out``'s dtype."""
    _check(expert_out, row_of, weights, padding_rows)
    if current_platform().kernel_backend == "triton":
        return _moe_combine_triton(expert_out, row_of, weights, padding_rows)
    return moe_combine_ref(expert_out, row_of, weights, padding_rows)


@moe_combine.register_fake
def _(expert_out, row_of, weights, padding_rows=None):
    return expert_out.new_empty((row_of.shape[0], expert_out.shape[1]))


# ------------------------------------------------------------------------------------ pure-torch reference


def moe_combine_ref(expert_out: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor,
                    padding_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's k rows in fp32, weighted and summed in j order (the kernel's order), one rounding out."""
    tokens, top_k = row_of.shape
    rows = expert_out[row_of.reshape(-1)].view(tokens, top_k, -1).float()
    acc = rows[:, 0] * weights[:, 0, None].float()
    for j in range(1, top_k):
        acc = acc + rows[:, j] * weights[:, j, None].float()
    if padding_rows is not None:  # their rows were never written: whatever they hold must not reach the output
        acc = acc.masked_fill(padding_rows.unsqueeze(-1), 0.0)
    return acc.to(expert_out.dtype)
