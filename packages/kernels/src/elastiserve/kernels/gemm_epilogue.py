"""The output side of the dense GEMM kernels (``nested_gemm``'s pointer kernel and ``gemm_tma``'s descriptor
kernel): the fp32 accumulator scaled, then stored as fp16 with the bias, or as this split's fp32 partial, which the
split that arrives last sums in split order (``arrivals.py``) into the fp16 output. One helper, so the two kernels'
outputs are the same bits for the same accumulators.
"""

from __future__ import annotations

import triton
import triton.language as tl

from elastiserve.kernels.arrivals import last_to_arrive


@triton.jit
def store_gemm_tile(acc, x_scale_ptr, bias_ptr, out_ptr, final_ptr, counters_ptr, tile, pid_k, offs_m, offs_n, M, N,
                    stride_os, stride_om, stride_on, w_scale, SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SPLIT_K: tl.constexpr, MERGE: tl.constexpr):
    """``acc`` [BLOCK_M, BLOCK_N] fp32 for rows ``offs_m`` and columns ``offs_n``. ``SCALE_ROWS``: multiply row m by
    ``x_scale[m] * w_scale`` (fp8 rows), else by ``w_scale`` (a power of two: exact). ``SPLIT_K > 1``: ``out_ptr``
    holds the fp32 partials [S, M, N] and, with ``MERGE``, the last split of tile ``tile`` writes ``final_ptr``."""
    mask_m = offs_m < M
    mask_n = offs_n < N
    if SCALE_ROWS:
        x_scale = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)
        acc = acc * (x_scale[:, None] * w_scale)
    else:
        acc = acc * w_scale  # 2^weight_exp: exact, and 1.0 for an unscaled layer
    out_off = offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_off, acc.to(tl.float16), mask=out_mask)
    else:
        tl.store(out_ptr + pid_k * stride_os + out_off, acc, mask=out_mask)
        if MERGE:  # noqa: SIM102 (a constexpr branch of its own: the atomic stays out of the unmerged compile)
            if last_to_arrive(counters_ptr + tile, SPLIT_K):
                # In split order, as _split_k_reduce_kernel adds them: the same fp32 sums, bit for bit.
                total = tl.load(out_ptr + out_off, mask=out_mask, other=0.0)
                for split in tl.static_range(1, SPLIT_K):
                    total += tl.load(out_ptr + split * stride_os + out_off, mask=out_mask, other=0.0)
                if HAS_BIAS:
                    total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                tl.store(final_ptr + out_off, total.to(tl.float16), mask=out_mask)
                tl.store(counters_ptr + tile, 0)
