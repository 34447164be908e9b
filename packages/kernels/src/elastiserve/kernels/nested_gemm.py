"""Nested-weight GEMM ``y = x @ W.T (+ bias)`` with W held as two uint8 planes ``upper[N, K]``, ``lower[N, K]``.

Modes (``MODE`` constexpr):
* full (0): rebuild the exact fp16 weight in registers with integer ops only (portable), fp16 ``tl.dot``.
* weight_only (1): fast mode, upper plane only, upcast to fp16 in registers (W8A16): half the weight bytes.
* fp8 (2): fast mode on archs with fp8 MMA: activations quantized per token to e4m3 (``quantize_per_token``),
  ``tl.dot`` on fp8 operands; MI300 reads the OCP bytes as FNUZ (0x80 -> 0, scale doubled).

Full and weight-only modes at decode sizes go to the GEMV-style kernel in ``skinny_gemm.py`` where
``skinny_configs.SKINNY_MAX_M`` routes (arch, mode, M) there and no explicit ``config`` was passed.

Split-K configs sum their fp32 partials in ``_split_k_reduce_kernel``, or, where ``SPLIT_K_MERGE`` says so, in the
GEMM launch itself: the last split of a tile to finish adds them up (``arrivals.py``), in the same order.

A prescaled E4M3 layer (planes of ``w * 2^-weight_exp``) gets its ``2^weight_exp`` back in the epilogue: the fp32
accumulator is multiplied by ``w_scale`` (a power of two, so exact) before the bias.

Registered ops: ``elastiserve::nested_linear(x, upper, lower, bias, nesting, fast, weight_exp=0)`` and
``elastiserve::nested_linear_fp8(q, scale, upper, lower, bias, nesting, weight_exp=0)``, the fp8 mode on rows that a
quantizing norm or SiLU-and-mul already turned into fp8 (``fp8_activations.py``); pure-torch references at the bottom
(``nested_linear_ref``, ``nested_linear_fp8_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastiserve.kernels import configs, formats, skinny_configs
from elastiserve.kernels.arrivals import arrival_counters
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.fp8_activations import (
    QUANT_SHORT_K,
    check_fp8_rows,
    platform_fnuz,
    quantize_per_token,
    quantize_per_token_ref,
)
from elastiserve.kernels.gemm_epilogue import store_gemm_tile
from elastiserve.kernels.gemm_tma import TMA_MODES, launch_gemm_tma, tma_ready
from elastiserve.kernels.l2_prefetch import prefetch_plan, prefetch_rows_l2
from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.kernels.merge_planes import full_via_merged_weight
from elastiserve.kernels.weight_decode import load_weight_tile
from elastiserve.platforms import ConfigError, FastGemm, Vendor, current_platform
from elastiserve.platforms.env import triton_interpret

FULL, WEIGHT_ONLY, FP8 = 0, 1, 2
MODE_IDS = {"full": FULL, "weight_only": WEIGHT_ONLY, "fp8": FP8}
# Where fast mode switches from the weight-only path (fp16 activations) to fp8 MMA (per-token activation
# quantization: one more launch and one more rounding). With the portable decode fp8 won at every M on the H200
# (qkv 6144x4096 at M=1: 15.2 us vs 23.3 us; h200-nested-gemm-run1.json), so fp8-capable GPUs take it from the first
# row. On sm90 the weight-only path with the PTX decode on narrow tiles matched or beat fp8 at decode sizes, side by
# side (h200-gemm-config-probe-run3: qkv M=1 13.2 vs 13.4 us, M=16 13.1 vs 13.9; down M=1 28.0 vs 28.0, M=16 28.7 vs
# 29.0), so sm90 kept fp16 activations up to 16 rows. With the one-pass quantizer (2.2 us instead of 3.1 at K = 4096,
# 5.1 instead of 9.0 at 14336) fp8 won at 16 rows on all eight shapes in session 16's GEMM table
# (h200-nested-gemm-s16.json, side by side: qkv 12.9 vs 13.1 us, o 10.5 vs 10.6, gate_up 39.0 vs 42.4, down 24.7 vs
# 28.7, Qwen3 gate_up 29.3 vs 35.6, down 22.9 vs 26.3). Both run a 16-row token tile from 2 rows on, so that holds
# from 2 rows; one row keeps the skinny weight-only kernel (1.58-1.84x fp16). The grouped MoE GEMM: fp8 from row 1.
# Session 22 timed the skinny weight-only kernel at two rows against it, side by side (GEMM table,
# benchmarks/kernels/results/h200-nested-gemm-s22-m12.json): o_proj 8.6 vs 8.7 us, but qkv 11.7 vs 10.0 and gate_up
# 45.8 vs 31.5; the engine's batch-2 fast step with o_proj on it was 2.765 ms against 2.767 (same call). Kept at 2.
FP8_MIN_M = {"sm90": 2}
# The same threshold for rows that arrive already quantized (``Fp8Rows`` from a quantizing norm or SiLU-and-mul),
# where fp8 costs no quantizer launch: one row on sm90. Session 18's GEMM table at one row, side by side on the H200
# (benchmarks/kernels/results/h200-nested-gemm-s18.json): fp8 on quantized rows against the skinny weight-only kernel,
# qkv 9.2 vs 10.4 us, gate_up 30.3 vs 35.8, down 18.4 vs 18.4; the engine's batch-1 fast step 3.235 -> 3.199 ms
# (bench_decode.py --fp8-min-rows-quantized 1 vs 2, h200-llama8b-decode-run11-q{1,2}.json). o_proj, which quantizes
# for itself, keeps FP8_MIN_M.
# Session 22 tried qkv's one row back on the weight-only kernel (its norm then plain, 1.1 us against 1.8) with gate_up
# on fp8: batch-1 fast step 2.587 -> 2.580 ms, less than one tree moves between calls (h200-llama8b-decode-s22-call2-*,
# option removed after it; code at 68ec7d0).
FP8_MIN_M_QUANTIZED_INPUT = {"sm90": 1}
# ... except for rows longer than QUANT_SHORT_K (down_proj's, K = 14336): one quantizing SiLU-and-mul program holds
# such a row, and at one row it costs 5.4 us a call against the plain kernel's 1.5 (session 19's decode profile,
# batch 1, benchmarks/engine/results/h200-decode-kernels-s19.json: 172 us a step against 47), while the down GEMM at
# one row gains nothing from fp8 (18.4 us either way, h200-nested-gemm-s18.json). Timed in session 20 against 1,
# side by side: batch-1 fast step 2.973 -> 2.860 ms (h200-llama8b-decode-s20-call2-*.json). From two rows fp8 wins:
# weight-only there made the step slower (3.107 -> 3.435 ms at batch 2 with o_proj's rows, s20-call3-*.json).
FP8_MIN_M_QUANTIZED_LONG_INPUT = {"sm90": 2}
# Where the split-K partials are summed by the tile's last split inside the GEMM launch (arrivals.py) instead of by
# _split_k_reduce_kernel: the reduce costs a launch, 36 us a batch-2 fast step on the H200 (down_proj's two splits,
# session 22's profile, h200-decode-kernels-s22-pdl-off.json). Timed side by side on the H200 (session 23, call 1,
# Llama-3.1-8B decode step): equal at batches 1-2 and 32, 20-55 us faster in full mode at batches 4-16 (b16 5.509 ->
# 5.454 ms) and within +-26 us in fast mode.
SPLIT_K_MERGE = {"cpu": True, "sm90": True}


@triton.jit
def _nested_gemm_kernel(
    x_ptr, x_scale_ptr, upper_ptr, lower_ptr, bias_ptr, out_ptr,
    final_ptr,  # [M, N] fp16 that the last split of a tile writes (MERGE); out_ptr then holds the fp32 partials
    counters_ptr,  # int32 arrival counter per (M, N) tile (MERGE; arrivals.py), zero before and after the launch
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ln, stride_lk, stride_os, stride_om, stride_on,
    w_scale,
    MODE: tl.constexpr, NESTING: tl.constexpr, FNUZ: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, PTX_DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    MERGE: tl.constexpr = False, PDL: tl.constexpr = False,
    PREFETCH_ROW_BYTES: tl.constexpr = 0, PREFETCH_CHUNKS: tl.constexpr = 1,  # l2_prefetch.prefetch_plan
    PREFETCH_THREADS: tl.constexpr = 32,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row tiles sweep N together so their x tiles stay in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K
    if PREFETCH_ROW_BYTES > 0:  # before the wait: no kernel of a step writes the weights (l2_prefetch.py)
        prefetch_rows_l2(upper_ptr, pid_n * BLOCK_N, N, stride_wn, k_start, BLOCK_N, PREFETCH_ROW_BYTES,
                         PREFETCH_CHUNKS, PREFETCH_THREADS)
        if MODE == 0:
            prefetch_rows_l2(lower_ptr, pid_n * BLOCK_N, N, stride_ln, k_start, BLOCK_N, PREFETCH_ROW_BYTES,
                             PREFETCH_CHUNKS, PREFETCH_THREADS)
    wait_for_prior_grid(PDL)

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        offs_k = k_start + kk + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        if EVEN_K:  # no K mask: keeps the loads fully vectorized
            w_mask = mask_n[:, None]
        else:
            w_mask = mask_n[:, None] & mask_k[None, :]
        w = load_weight_tile(upper_ptr, lower_ptr, offs_n, offs_k, stride_wn, stride_wk, stride_ln, stride_lk, w_mask,
                             MODE, NESTING, FNUZ, PTX_DECODE)  # [BLOCK_N, BLOCK_K]
        if SWAP_AB:
            if EVEN_K:
                x_mask = mask_m[None, :]
            else:
                x_mask = mask_m[None, :] & mask_k[:, None]
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None] * stride_xk, mask=x_mask, other=0.0)
            acc = tl.dot(w, xt, acc)
        else:
            if EVEN_K:
                x_mask = mask_m[:, None]
            else:
                x_mask = mask_m[:, None] & mask_k[None, :]
            xa = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=x_mask, other=0.0)
            acc = tl.dot(xa, tl.trans(w), acc)

    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    store_gemm_tile(acc, x_scale_ptr, bias_ptr, out_ptr, final_ptr, counters_ptr, pid, pid_k, offs_m, offs_n, M, N,
                    stride_os, stride_om, stride_on, w_scale, MODE == 2, HAS_BIAS, SPLIT_K, MERGE)


@triton.jit
def _split_k_reduce_kernel(partial_ptr, bias_ptr, out_ptr, M, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_prior_grid(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(partial_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(partial_ptr + s * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(tl.float16), mask=mask)


def upper_for_kernel(upper: torch.Tensor, nesting: int, mode: str, fnuz: bool) -> torch.Tensor:
    """OCP fp8 mode reads the plane through an fp8 pointer (zero-copy view) so tiles go straight to the MMA."""
    if mode == "fp8" and not fnuz:
        return formats.upper_as_fp8(upper, Nesting(nesting))[0]
    return upper


def lower_for_kernel(upper: torch.Tensor, lower: torch.Tensor, mode: str) -> torch.Tensor:
    """The pointer a kernel gets for the lower plane: the plane in full mode, else the upper plane, which is always
    mapped. A fast-mode layer's lower plane is what the restore worker remaps (unmap, map, grant access) on its own
    thread, and Triton's launcher checks every pointer argument, read or not: an eager fast-mode launch inside that
    window raised "Pointer argument (at 3) cannot be accessed" on the H200 (combined, MoE, session 9)."""
    return lower if mode == "full" else upper


def weight_scale(nesting: int, mode: str, fnuz: bool, weight_exp: int = 0) -> float:
    """What the kernel multiplies its fp32 accumulator by: the prescale ``2^weight_exp``, times the fp8 scale."""
    prescale = 2.0 ** formats.check_weight_exp(weight_exp)
    if mode != "fp8":
        return prescale
    base = formats.E4M3_WEIGHT_SCALE if nesting == Nesting.E4M3 else formats.E5M2_WEIGHT_SCALE
    return prescale * (base * 2.0 if fnuz else base)  # an OCP byte read as FNUZ is value / 2


def check_ptx_decode(config: configs.GemmConfig | skinny_configs.SkinnyConfig, platform) -> None:
    """A tabled or explicit PTX decode that cannot run here raises instead of silently decoding portably."""
    if config.ptx_decode and (platform.vendor is not Vendor.NVIDIA or triton_interpret()):
        raise ConfigError(f"ptx_decode needs an NVIDIA GPU (not the interpreter); platform is {platform.arch}")


def register_cap(config: configs.GemmConfig) -> dict:
    """The launch option of ``config.max_registers`` (none when unset, and an error off NVIDIA GPUs)."""
    if config.max_registers is None:
        return {}
    platform = current_platform()
    if platform.vendor is not Vendor.NVIDIA or triton_interpret():
        raise ConfigError(f"max_registers needs an NVIDIA GPU (not the interpreter); platform is {platform.arch}")
    return {"maxnreg": config.max_registers}


def nested_gemm(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, bias: torch.Tensor | None,
                nesting: int, mode: str, *, fnuz: bool = False, weight_exp: int = 0,
                config: configs.GemmConfig | None = None, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the Triton kernel(s): x fp16 [M, K], planes uint8 [N, K] (of ``w * 2^-weight_exp``) -> fp16 [M, N].

    ``x_scale`` (fp8 mode only): x is already ``quantize_per_token``'s fp8 rows and this their fp32 scales [M], as
    the quantizing norms and SiLU-and-mul write them (``fp8_activations.py``); the GEMM then launches alone."""
    if x_scale is not None:
        if mode != "fp8":
            raise ConfigError(f"pre-quantized fp8 rows feed fp8 mode only, not {mode!r}")
        check_fp8_rows(x, x_scale, fnuz)
    elif x.dim() != 2 or x.dtype != torch.float16:
        raise ValueError(f"x must be 2-D fp16, got {tuple(x.shape)} {x.dtype}")
    if upper.shape != lower.shape or upper.dtype != torch.uint8 or lower.dtype != torch.uint8:
        raise ValueError("upper and lower must be uint8 planes of one shape")
    if nesting not in (Nesting.E4M3, Nesting.E5M2):
        raise ValueError(f"nesting must be E4M3 or E5M2, got {nesting}")
    m, k = x.shape
    n = upper.shape[0]
    if upper.shape[1] != k:
        raise ValueError(f"x has K={k} but the weight planes are {tuple(upper.shape)}")
    if m == 0:
        return torch.empty((m, n), dtype=torch.float16, device=x.device)
    platform = current_platform()
    if config is None:
        skinny = skinny_configs.choose_skinny(platform.arch, mode, m, n, k, platform.num_sms)
        if skinny is not None:
            from elastiserve.kernels import skinny_gemm  # deferred: skinny_gemm imports this module at its top

            return skinny_gemm.skinny_nested(x, upper, lower, bias, nesting, mode, fnuz=fnuz, weight_exp=weight_exp,
                                             config=skinny)
        config = configs.choose_config(platform.arch, mode, m, n, k, platform.num_sms)
    if mode == "fp8" and config.block_k < 32:
        raise ConfigError(f"fp8 tl.dot needs BLOCK_K >= 32, got {config}")
    if config.tma and (mode not in TMA_MODES or fnuz):
        raise ConfigError(f"tma tiles run full and OCP fp8 mode, not {mode!r} (fnuz={fnuz}): {config}")
    check_ptx_decode(config, platform)
    if mode == "fp8" and x_scale is None:
        x, x_scale = quantize_per_token(x, fnuz)
    split = config.split_k
    out = torch.empty((m, n), dtype=torch.float16, device=x.device)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    merge = split > 1 and bool(SPLIT_K_MERGE.get(platform.arch, False))
    counters = arrival_counters("nested_gemm", x.device, tiles) if merge else out
    k_per_split = triton.cdiv(triton.cdiv(k, config.block_k), split) * config.block_k
    if config.tma:
        launch_gemm_tma(x, x_scale, upper_for_kernel(upper, nesting, mode, fnuz), lower if mode == "full" else None,
                        bias, nesting, mode, weight_scale(nesting, mode, fnuz, weight_exp), config,
                        target, out, counters, k_per_split, tiles, merge)
    else:
        # Prefetch where one row tile reads the weight once (decode sizes); larger M is bound by the MMAs.
        prefetch = prefetch_plan(upper, mode, config.block_n, tiles * split, k_per_split, split, config.num_warps,
                                 lower=lower) if m <= config.block_m else {}
        _nested_gemm_kernel[(tiles, split)](
            x, x if x_scale is None else x_scale,  # the scale pointer is read in fp8 mode only
            upper_for_kernel(upper, nesting, mode, fnuz), lower_for_kernel(upper, lower, mode),
            bias if bias is not None else x, target, out, counters,
            m, n, k, k_per_split,
            x.stride(0), x.stride(1), upper.stride(0), upper.stride(1), lower.stride(0), lower.stride(1),
            target.stride(0) if split > 1 else 0, target.stride(-2), target.stride(-1),
            weight_scale(nesting, mode, fnuz, weight_exp),
            MODE=MODE_IDS[mode], NESTING=int(nesting), FNUZ=fnuz, HAS_BIAS=bias is not None,
            SPLIT_K=split, SWAP_AB=config.swap_ab, EVEN_K=k % (config.block_k * split) == 0,
            PTX_DECODE=config.ptx_decode,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            MERGE=merge, num_warps=config.num_warps, num_stages=config.num_stages, **register_cap(config),
            **pdl_options(), **prefetch,
        )
    if split > 1 and not merge:
        reduce_split_k(target, bias, out)
    return out


def reduce_split_k(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out[M, N] (fp16) = sum of the contiguous fp32 partials[S, M, N] over S, plus bias."""
    split, m, n = partials.shape
    block = 1024
    _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
        partials, bias if bias is not None else out, out, m, n, SPLIT_K=split, HAS_BIAS=bias is not None,
        BLOCK=block, num_warps=4, **pdl_options())


def fast_mode_for(m: int, *, grouped: bool = False, quantized_input: bool = False, k: int = 0) -> str:
    """Which fast-mode kernel this platform runs for an M-row input (``grouped``: the MoE GEMM's rows;
    ``quantized_input``: rows of ``k`` values a quantizing norm or SiLU-and-mul would hand over as ``Fp8Rows``)."""
    platform = current_platform()
    table = FP8_MIN_M
    if quantized_input:
        table = FP8_MIN_M_QUANTIZED_LONG_INPUT if k > QUANT_SHORT_K else FP8_MIN_M_QUANTIZED_INPUT
    min_m = 1 if grouped else table.get(platform.arch, 1)
    if platform.fast_gemm in (FastGemm.FP8_MMA, FastGemm.FP8_MMA_FNUZ) and m >= min_m:
        return "fp8"
    return "weight_only"


def full_runs_merged(arch: str, x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor) -> bool:
    """Full mode's route for these rows: the materialized weight and the vendor GEMM (True) or the fused kernel.
    Rows that take TMA tiles (``configs.full_takes_tma``) take the materialized path where a tensor does not suit
    TMA (a strided or misaligned view), as they did before those tiles: a route, never a failed launch."""
    m, (n, k) = x.shape[0], upper.shape
    if configs.full_takes_tma(arch, m, n, k) and not all(tma_ready(t) for t in (x, upper, lower)):
        return True
    return configs.materializes_full(arch, m, n, k)


@torch.library.custom_op("elastiserve::nested_linear", mutates_args=())
def nested_linear_op(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, bias: torch.Tensor | None,
                     nesting: int, fast: bool, weight_exp: int = 0) -> torch.Tensor:
    mode = fast_mode_for(x.shape[0]) if fast else "full"
    platform = current_platform()
    if platform.kernel_backend == "reference":
        return nested_linear_ref(x, upper, lower, bias, nesting, mode, fnuz=platform_fnuz(), weight_exp=weight_exp)
    if mode == "full" and full_runs_merged(platform.arch, x, upper, lower):
        return full_via_merged_weight(x, upper, lower, bias, nesting, weight_exp)
    return nested_gemm(x, upper, lower, bias, nesting, mode, fnuz=platform_fnuz(), weight_exp=weight_exp)


@nested_linear_op.register_fake
def _(x, upper, lower, bias, nesting, fast, weight_exp=0):
    return x.new_empty((x.shape[0], upper.shape[0]))


@torch.library.custom_op("elastiserve::nested_linear_fp8", mutates_args=())
def nested_linear_fp8_op(q: torch.Tensor, scale: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                         bias: torch.Tensor | None, nesting: int, weight_exp: int = 0) -> torch.Tensor:
    """Fast mode's fp8 GEMM on rows already quantized (``quantize_per_token``'s pair, as the quantizing norms and
    SiLU-and-mul write it): what ``nested_linear`` computes in fp8 mode, without its quantizer launch."""
    fnuz = platform_fnuz()
    if current_platform().kernel_backend == "reference":
        check_fp8_rows(q, scale, fnuz)
        return nested_linear_fp8_ref(q, scale, upper, lower, bias, nesting, fnuz=fnuz, weight_exp=weight_exp)
    return nested_gemm(q, upper, lower, bias, nesting, "fp8", fnuz=fnuz, weight_exp=weight_exp, x_scale=scale)


@nested_linear_fp8_op.register_fake
def _(q, scale, upper, lower, bias, nesting, weight_exp=0):
    return q.new_empty((q.shape[0], upper.shape[0]), dtype=torch.float16)


# ---- pure-torch references ------------------------------------------------------------------------------------


def reference_weight(upper: torch.Tensor, lower: torch.Tensor, nesting: int, mode: str,
                     fnuz: bool = False, weight_exp: int = 0) -> torch.Tensor:
    """The fp32 weight each mode multiplies by (fp8 mode: the upper value times its scale), prescale included."""
    if mode == "full":
        return formats.merge(upper, lower, Nesting(nesting)).float() * 2.0 ** formats.check_weight_exp(weight_exp)
    if mode == "weight_only":
        return formats.upper_as_fp16(upper, Nesting(nesting), weight_exp).float()
    if fnuz:
        u = torch.where(upper == 0x80, torch.zeros_like(upper), upper)
        fp8 = torch.float8_e4m3fnuz if nesting == Nesting.E4M3 else torch.float8_e5m2fnuz
        return u.view(fp8).float() * weight_scale(nesting, mode, True, weight_exp)
    value, scale = formats.upper_as_fp8(upper, Nesting(nesting), weight_exp)
    return value.float() * scale


def nested_linear_ref(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, bias: torch.Tensor | None,
                      nesting: int, mode: str, *, fnuz: bool = False, weight_exp: int = 0) -> torch.Tensor:
    """fp32 math, fp16 out: what every kernel mode must match."""
    if mode == "fp8":
        q, scale = quantize_per_token_ref(x, fnuz)
        return nested_linear_fp8_ref(q, scale, upper, lower, bias, nesting, fnuz=fnuz, weight_exp=weight_exp)
    y = x.float() @ reference_weight(upper, lower, nesting, mode, fnuz, weight_exp).T
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.float16)


def nested_linear_fp8_ref(q: torch.Tensor, scale: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                          bias: torch.Tensor | None, nesting: int, *, fnuz: bool = False,
                          weight_exp: int = 0) -> torch.Tensor:
    """fp8 mode on quantized rows: fp32 math, fp16 out."""
    y = (q.float() @ reference_weight(upper, lower, nesting, "fp8", fnuz, weight_exp).T) * scale[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.float16)
