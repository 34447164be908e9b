"""Skinny decode GEMM ``y = x @ W.T (+ bias)`` for M <= 8 rows: GEMV-style, CUDA-core FMAs, no ``tl.dot``.

At decode sizes the tl.dot kernels pad M to a 16-row MMA tile and moved ~1.9 TB/s of weight bytes on the H200
(nested_gemm.py), cuBLAS fp16 ~3.0 TB/s, against ~4.3 TB/s the HBM can read. Here each program owns BLOCK_N output
columns, streams its [BLOCK_N, K-range] slab of the weight in [BLOCK_N, BLOCK_K] tiles with 128-bit loads and does the
M rows' multiply-adds in fp32 on CUDA cores. Weight formats (``MODE`` constexpr):
* plain (3): an fp16 weight [N, K] (the engine's plain linears);
* full (0) / weight_only (1): nested uint8 planes decoded by ``weight_decode.load_weight_tile`` (portable or packed
  PTX), with nested_gemm's ``w_scale = 2^weight_exp`` epilogue.

Reduction strategy. The weight is [N, K] with K contiguous, so the vector loads spread K across the lanes (and across
warps once BLOCK_K passes one warp's reach). A ``tl.sum`` over K every step costs 5 shuffle rounds per row and N-row a
thread holds (plus a shared-memory round trip when warps span K) for only 8 (fp16) or 16 (uint8) FMAs: at M = 8 that
is ~40 lane-shuffles per clock per SM at 4.3 TB/s, over the ~32 an SM issues (an estimate, not measured). So each row
by default keeps an fp32 accumulator [BLOCK_N, BLOCK_K / VEC]: every step a thread sums the VEC products of its own
128-bit weight load (VEC = 16 bytes of a nested plane, 8 fp16) in registers and adds them in; the cross-lane
reduction over K runs once, in the epilogue. Compiled for sm90, that took the one-row weight-only kernel from 64
registers (a whole-tile accumulator) to 30, full mode 73 -> 40, plain 97 -> 64, with no shuffle in the loop
(benchmarks/kernels/compile_report.py). Past ``DEFER_MAX_REGS`` accumulator registers per thread the kernel reduces
each step instead (``DEFER`` constexpr, from ``defers_reduction``) and keeps one [BLOCK_N] vector per row.
Rows are separate named accumulators rather than one [M_PAD, BLOCK_N, BLOCK_K] tensor, so every tensor in the loop
has the weight tile's shape and layout. Each x row is loaded as its K slice broadcast to the tile's shape: Triton's
coalescing then gives the x load the weight load's layout (both uint8 and fp16 weights), where a [BLOCK_K] x load went
through shared memory with a barrier, once per row per step. Compiled for sm90: no layout conversion, barrier or
shuffle in the loop of a deferred variant, no spills in any probe variant. The price is that a thread re-reads its x
slice (an L1 hit) for every weight row it holds; per-step variants whose K span crosses warps (fp16 BLOCK_K > 256 at 4
warps) reduce through shared memory every step.

Split-K writes fp32 partials [SPLIT_K, M, N] that ``nested_gemm.reduce_split_k`` sums (+ bias). Registered op:
``elastiserve::skinny_linear(x, weight, bias)`` (plain fp16); the nested modes are reached through
``nested_gemm.nested_gemm`` (so ``elastiserve::nested_linear``), routed by ``skinny_configs.choose_skinny``. Pure-torch
reference: ``skinny_linear_ref`` (nested: ``nested_gemm.nested_linear_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastiserve.kernels import nested_gemm, skinny_configs
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.l2_prefetch import prefetch_plan, prefetch_rows_l2
from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.kernels.skinny_configs import SKINNY_MAX_ROWS, SkinnyConfig
from elastiserve.kernels.weight_decode import PLAIN, load_weight_tile
from elastiserve.platforms import ConfigError, current_platform

MODE_IDS = {"full": nested_gemm.FULL, "weight_only": nested_gemm.WEIGHT_ONLY, "plain": PLAIN}
DEFER_MAX_REGS = 64  # fp32 accumulator registers per thread for the deferred (end-of-loop) K reduction


@triton.jit
def _row_fma(acc, w, x_ptr, row, M, K, offs_k, stride_xm, stride_xk, EVEN_K: tl.constexpr, DEFER: tl.constexpr,
             VEC: tl.constexpr):
    # Rows past M read row M - 1 (valid memory; the epilogue never stores them), so the x loads need no row mask.
    # Broadcast to the tile's shape so the load takes the weight tile's layout (module docstring).
    x_row = tl.broadcast_to(x_ptr + tl.minimum(row, M - 1) * stride_xm + offs_k[None, :] * stride_xk, w.shape)
    if EVEN_K:
        x = tl.load(x_row)
    else:
        x = tl.load(x_row, mask=tl.broadcast_to((offs_k < K)[None, :], w.shape), other=0.0)
    prod = w * x.to(tl.float32)
    if DEFER:  # (if/else, not an early return: the compiler checks every return's shape against the first)
        # Each thread's VEC contiguous K elements (one 128-bit weight load) summed in registers: no lane crosses.
        return acc + tl.sum(tl.reshape(prod, (prod.shape[0], prod.shape[1] // VEC, VEC)), axis=2)
    else:
        return acc + tl.sum(prod, axis=1)  # [BLOCK_N]


@triton.jit
def _zero_acc(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEFER: tl.constexpr, VEC: tl.constexpr):
    if DEFER:
        return tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_N,), dtype=tl.float32)


@triton.jit
def _store_row(acc, row, out_ptr, bias, offs_n, mask_n, M, stride_om, stride_on, w_scale,
               DEFER: tl.constexpr, PARTIAL: tl.constexpr):
    if DEFER:
        y = tl.sum(acc, axis=1)
    else:
        y = acc
    y = y * w_scale  # 2^weight_exp: exact, and 1.0 for plain and unscaled layers
    ptrs = out_ptr + row * stride_om + offs_n * stride_on
    if PARTIAL:  # fp32 partial; the split-K reduce adds the bias
        tl.store(ptrs, y, mask=mask_n & (row < M))
    else:
        tl.store(ptrs, (y + bias).to(tl.float16), mask=mask_n & (row < M))


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K] fp16
    w_ptr,  # [N, K] fp16 weight (plain) or uint8 upper plane
    lower_ptr,  # [N, K] uint8 lower plane (full mode; any valid pointer otherwise)
    bias_ptr,  # [N] fp16
    out_ptr,  # [M, N] fp16, or [SPLIT_K, M, N] fp32 partials
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ln, stride_lk, stride_os, stride_om, stride_on,
    w_scale,
    MODE: tl.constexpr, NESTING: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # SPLIT_K > 1; a bool rather than the split count, so every split shares one compile
    EVEN_K: tl.constexpr, PTX_DECODE: tl.constexpr, DEFER: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,  # weight elements in one 128-bit load (vector_width): the accumulator's K grouping
    PDL: tl.constexpr = False,
    PREFETCH_ROW_BYTES: tl.constexpr = 0, PREFETCH_CHUNKS: tl.constexpr = 1,  # l2_prefetch.prefetch_plan
    PREFETCH_THREADS: tl.constexpr = 32,
):
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_start = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K
    if PREFETCH_ROW_BYTES > 0:  # before the wait: no kernel of a step writes the weights (l2_prefetch.py)
        w_bytes = 2 if MODE == 3 else 1  # plain fp16, else a uint8 plane
        prefetch_rows_l2(w_ptr, tl.program_id(0) * BLOCK_N, N, stride_wn * w_bytes, k_start * w_bytes, BLOCK_N,
                         PREFETCH_ROW_BYTES, PREFETCH_CHUNKS, PREFETCH_THREADS)
        if MODE == 0:
            prefetch_rows_l2(lower_ptr, tl.program_id(0) * BLOCK_N, N, stride_ln, k_start, BLOCK_N,
                             PREFETCH_ROW_BYTES, PREFETCH_CHUNKS, PREFETCH_THREADS)
    wait_for_prior_grid(PDL)
    # One accumulator per row (Triton has no register arrays); rows >= M_PAD stay untouched and are dead code.
    acc0 = _zero_acc(BLOCK_N, BLOCK_K, DEFER, VEC)
    acc1 = _zero_acc(BLOCK_N, BLOCK_K, DEFER, VEC)
    acc2 = _zero_acc(BLOCK_N, BLOCK_K, DEFER, VEC)
    acc3 = _zero_acc(BLOCK_N, BLOCK_K, DEFER, VEC)
    acc4 = _zero_acc(BLOCK_N, BLOCK_K, DEFER, VEC)
    acc5 = _zero_acc(BLOCK_N, BLOCK_K, DEFER, VEC)
    acc6 = _zero_acc(BLOCK_N, BLOCK_K, DEFER, VEC)
    acc7 = _zero_acc(BLOCK_N, BLOCK_K, DEFER, VEC)
    for kk in range(0, k_per_split, BLOCK_K):
        offs_k = k_start + kk + tl.arange(0, BLOCK_K)
        if EVEN_K:  # no K mask: keeps the loads fully vectorized
            w_mask = mask_n[:, None]
        else:
            w_mask = mask_n[:, None] & (offs_k < K)[None, :]
        w = load_weight_tile(w_ptr, lower_ptr, offs_n, offs_k, stride_wn, stride_wk, stride_ln, stride_lk, w_mask,
                             MODE, NESTING, False, PTX_DECODE)  # MODE PLAIN loads the fp16 weight as it is
        w = w.to(tl.float32)
        acc0 = _row_fma(acc0, w, x_ptr, 0, M, K, offs_k, stride_xm, stride_xk, EVEN_K, DEFER, VEC)
        if M_PAD > 1:
            acc1 = _row_fma(acc1, w, x_ptr, 1, M, K, offs_k, stride_xm, stride_xk, EVEN_K, DEFER, VEC)
        if M_PAD > 2:
            acc2 = _row_fma(acc2, w, x_ptr, 2, M, K, offs_k, stride_xm, stride_xk, EVEN_K, DEFER, VEC)
            acc3 = _row_fma(acc3, w, x_ptr, 3, M, K, offs_k, stride_xm, stride_xk, EVEN_K, DEFER, VEC)
        if M_PAD > 4:
            acc4 = _row_fma(acc4, w, x_ptr, 4, M, K, offs_k, stride_xm, stride_xk, EVEN_K, DEFER, VEC)
            acc5 = _row_fma(acc5, w, x_ptr, 5, M, K, offs_k, stride_xm, stride_xk, EVEN_K, DEFER, VEC)
            acc6 = _row_fma(acc6, w, x_ptr, 6, M, K, offs_k, stride_xm, stride_xk, EVEN_K, DEFER, VEC)
            acc7 = _row_fma(acc7, w, x_ptr, 7, M, K, offs_k, stride_xm, stride_xk, EVEN_K, DEFER, VEC)

    out_ptr += pid_k * stride_os
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS and not PARTIAL:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    _store_row(acc0, 0, out_ptr, bias, offs_n, mask_n, M, stride_om, stride_on, w_scale, DEFER, PARTIAL)
    if M_PAD > 1:
        _store_row(acc1, 1, out_ptr, bias, offs_n, mask_n, M, stride_om, stride_on, w_scale, DEFER, PARTIAL)
    if M_PAD > 2:
        _store_row(acc2, 2, out_ptr, bias, offs_n, mask_n, M, stride_om, stride_on, w_scale, DEFER, PARTIAL)
        _store_row(acc3, 3, out_ptr, bias, offs_n, mask_n, M, stride_om, stride_on, w_scale, DEFER, PARTIAL)
    if M_PAD > 4:
        _store_row(acc4, 4, out_ptr, bias, offs_n, mask_n, M, stride_om, stride_on, w_scale, DEFER, PARTIAL)
        _store_row(acc5, 5, out_ptr, bias, offs_n, mask_n, M, stride_om, stride_on, w_scale, DEFER, PARTIAL)
        _store_row(acc6, 6, out_ptr, bias, offs_n, mask_n, M, stride_om, stride_on, w_scale, DEFER, PARTIAL)
        _store_row(acc7, 7, out_ptr, bias, offs_n, mask_n, M, stride_om, stride_on, w_scale, DEFER, PARTIAL)


def vector_width(mode: str) -> int:
    """Weight elements in one 128-bit load: 8 fp16 (plain) or 16 bytes of a nested plane."""
    return 8 if mode == "plain" else 16


def defers_reduction(config: SkinnyConfig, m_pad: int, mode: str) -> bool:
    """Whether the M_PAD rows' accumulators ([BLOCK_N, BLOCK_K / vector_width] fp32 each) fit in ``DEFER_MAX_REGS``
    registers per thread."""
    tile = config.block_n * config.block_k // vector_width(mode)
    return m_pad * tile <= DEFER_MAX_REGS * 32 * config.num_warps


def _check_inputs(x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.dtype != torch.float16:
        raise ValueError(f"x must be 2-D fp16, got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]} but the weight has K={k}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float16):
        raise ValueError(f"bias must be fp16 [{n}], got {tuple(bias.shape)} {bias.dtype}")


def _check_plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2 or weight.dtype != torch.float16:
        raise ValueError(f"weight must be 2-D fp16, got {tuple(weight.shape)} {weight.dtype}")
    _check_inputs(x, weight.shape[0], weight.shape[1], bias)


def _launch(x, w, lower, bias, mode: str, nesting: int, w_scale: float, config: SkinnyConfig | None) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    if m > SKINNY_MAX_ROWS:
        raise ConfigError(f"the skinny GEMM takes at most {SKINNY_MAX_ROWS} rows, got M={m} ({config})")
    out = torch.empty((m, n), dtype=torch.float16, device=x.device)
    if m == 0:
        return out
    platform = current_platform()
    if config is None:
        config = skinny_configs.skinny_config(platform.arch, mode, m, n, k, platform.num_sms)
    nested_gemm.check_ptx_decode(config, platform)
    m_pad = triton.next_power_of_2(m)
    split = config.split_k
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, config.block_k), split) * config.block_k
    prefetch = prefetch_plan(w, mode, config.block_n, triton.cdiv(n, config.block_n) * split, k_per_split, split,
                             config.num_warps, lower=lower)
    _skinny_gemm_kernel[(triton.cdiv(n, config.block_n), split)](
        x, w, lower, bias if bias is not None else x, target,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), lower.stride(0), lower.stride(1),
        target.stride(0) if split > 1 else 0, target.stride(-2), target.stride(-1),
        w_scale,
        MODE=MODE_IDS[mode], NESTING=nesting, HAS_BIAS=bias is not None, PARTIAL=split > 1,
        EVEN_K=k % (config.block_k * split) == 0, PTX_DECODE=config.ptx_decode,
        DEFER=defers_reduction(config, m_pad, mode), M_PAD=m_pad, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        VEC=vector_width(mode),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(), **prefetch,
    )
    if split > 1:
        nested_gemm.reduce_split_k(target, bias, out)
    return out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """Launch the skinny kernel on a plain weight: x fp16 [M <= 8, K], weight fp16 [N, K], bias fp16 [N] -> fp16 [M, N].

    ``config`` None takes ``skinny_configs.skinny_config`` for this platform (whether or not the dispatch table would
    route these sizes here); ``elastiserve::skinny_linear`` is the dispatching op.
    """
    _check_plain(x, weight, bias)
    if config is not None and config.ptx_decode:
        raise ConfigError(f"ptx_decode decodes nested planes; a plain fp16 weight has none to decode ({config})")
    return _launch(x, weight, weight, bias, "plain", 0, 1.0, config)


def skinny_nested(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, bias: torch.Tensor | None,
                  nesting: int, mode: str, fnuz: bool = False, weight_exp: int = 0,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """Launch the skinny kernel on nested planes (uint8 [N, K] of ``w * 2^-weight_exp``) in full or weight-only mode.

    ``fnuz`` only matters to fp8 mode, which this kernel does not run; it is taken so the signature matches
    ``nested_gemm.nested_gemm``.
    """
    if mode not in ("full", "weight_only"):
        raise ConfigError(f"the skinny GEMM runs full and weight_only nested modes, not {mode!r}")
    if upper.dim() != 2 or upper.shape != lower.shape or upper.dtype != torch.uint8 or lower.dtype != torch.uint8:
        raise ValueError("upper and lower must be 2-D uint8 planes of one shape")
    if nesting not in (Nesting.E4M3, Nesting.E5M2):
        raise ValueError(f"nesting must be E4M3 or E5M2, got {nesting}")
    _check_inputs(x, upper.shape[0], upper.shape[1], bias)
    w_scale = nested_gemm.weight_scale(nesting, mode, fnuz, weight_exp)
    return _launch(x, upper, nested_gemm.lower_for_kernel(upper, lower, mode), bias, mode, int(nesting), w_scale,
                   config)


@torch.library.custom_op("elastiserve::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A plain fp16 linear: the skinny kernel where ``skinny_configs.choose_skinny`` routes these sizes, else
    torch's."""
    _check_plain(x, weight, bias)
    platform = current_platform()
    if platform.kernel_backend == "reference":
        return skinny_linear_ref(x, weight, bias)
    m, k = x.shape
    config = skinny_configs.choose_skinny(platform.arch, "plain", m, weight.shape[0], k, platform.num_sms)
    if config is None:
        return torch.nn.functional.linear(x, weight, bias)
    return skinny_linear(x, weight, bias, config)


@skinny_linear_op.register_fake
def _(x, weight, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


# ---- pure-torch reference ------------------------------------------------------------------------------------


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 math, fp16 out."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.float16)
