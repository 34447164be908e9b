"""Nested-weight GEMM ``y = x @ W.T (+ bias)`` with W held as two uint8 planes ``upper[N, K]``, ``lower[N, K]``.

Modes (``MODE`` constexpr):
* full (0): rebuild the exact fp16 weight in registers with integer ops only (portable), fp16 ``tl.dot``.
* weight_only (1): fast mode, upper plane only, upcast to fp16 in registers (W8A16): half the weight bytes.
* fp8 (2): fast mode on archs with fp8 MMA: activations quantized per token to e4m3 (``quantize_per_token``),
  ``tl.dot`` on fp8 operands; MI300 reads the OCP bytes as FNUZ (0x80 -> 0, scale doubled).

Full and weight-only modes at decode sizes go to the GEMV-style kernel in ``skinny_gemm.py`` where
``configs.SKINNY_MAX_M`` routes (arch, mode, M) there and no explicit ``config`` was passed.

A prescaled E4M3 layer (planes of ``w * 2^-weight_exp``) gets its ``2^weight_exp`` back in the epilogue: the fp32
accumulator is multiplied by ``w_scale`` (a power of two, so exact) before the bias.

Registered op: ``elastiserve::nested_linear(x, upper, lower, bias, nesting, fast, weight_exp=0)``; pure-torch
references at the bottom (``nested_linear_ref``, ``quantize_per_token_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastiserve.kernels import configs, formats
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.merge_planes import merge_planes
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
FP8_MIN_M = {"sm90": 2}
# A row is quantized from registers in one read of x (up to 16 warps: 32 fp32 values a thread) when it is short, or
# when there are few rows; else a loop over 1,024-wide chunks reads it twice (4 warps, one program a row). On the
# H200 (session 16, benchmarks/kernels/results/h200-vendor-fp8-s16.json and h200-fp8-tiles-s16.json): K = 4096 one
# pass 2.2 us at 16-64 rows and 19.4 us at 4,096 rows against 3.1 / 21.5 us for the loop; K = 14336 one pass 5.1 us
# at 32-128 rows against 9.0 us, but 16.5 / 38.8 / 178.8 us at 512 / 1,024 / 4,096 rows against the loop's 10.0 /
# 17.4 / 88.9 us (512-thread programs holding a whole row: too few resident to hide the load's latency).
QUANT_ONE_PASS_MAX_K = 16384
QUANT_SHORT_K, QUANT_FEW_ROWS = 4096, 128
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
_FP8_MIN_NORMAL = {torch.float8_e4m3fn: 2.0**-6, torch.float8_e4m3fnuz: 2.0**-7}
_SCALE_FLOOR = 1e-8


@triton.jit
def _nested_gemm_kernel(
    x_ptr, x_scale_ptr, upper_ptr, lower_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ln, stride_lk, stride_os, stride_om, stride_on,
    w_scale,
    MODE: tl.constexpr, NESTING: tl.constexpr, FNUZ: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, PTX_DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
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
    if MODE == 2:
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


@triton.jit
def _split_k_reduce_kernel(partial_ptr, bias_ptr, out_ptr, M, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(partial_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(partial_ptr + s * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(tl.float16), mask=mask)


@triton.jit
def _to_fp8_range(x, scale, FP8_MAX: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr, MIN_NORMAL: tl.constexpr):
    q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)  # IEEE division, as the reference
    if ROUND_IN_SOFTWARE:
        # The Triton 3.6 interpreter's fp32 -> fp8 cast drops the carry when rounding crosses a power of two
        # (126.8 -> 64). Round to 3 mantissa bits here (RNE on the fp32 bits) so the cast is exact; below the
        # smallest normal the grid is fixed (MIN_NORMAL / 8): adding 1.5 * 2^23 steps rounds to it (RNE in fp32).
        bits = q.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        magic = MIN_NORMAL * 0.125 * 12582912.0
        small = ((tl.abs(q) + magic) - magic).to(tl.uint32, bitcast=True)
        small = (small | (bits & 0x80000000)).to(tl.float32, bitcast=True)  # q's sign, also on a zero
        q = tl.where(tl.abs(q) < MIN_NORMAL, small, normal)
    return q


@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, FP8_MAX: tl.constexpr,
                               MIN_NORMAL: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr, ONE_PASS: tl.constexpr,
                               BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * stride_qm
    if ONE_PASS:  # the whole row in registers: one read of x
        offs = tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-8), FP8_MAX)
        tl.store(scale_ptr + row, scale)
        q = _to_fp8_range(x, scale, FP8_MAX, ROUND_IN_SOFTWARE, MIN_NORMAL)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            offs = k + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-8), FP8_MAX)
        tl.store(scale_ptr + row, scale)
        for k in range(0, K, BLOCK_K):
            offs = k + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = _to_fp8_range(x, scale, FP8_MAX, ROUND_IN_SOFTWARE, MIN_NORMAL)
            tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def activation_fp8_dtype(fnuz: bool) -> torch.dtype:
    return torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn


def quantize_per_token(x: torch.Tensor, fnuz: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row e4m3 quantization: (x_fp8[M, K], scale[M] fp32) with x ~ x_fp8 * scale."""
    m, k = x.shape
    dtype = activation_fp8_dtype(fnuz)
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        one_pass = k <= QUANT_SHORT_K or (k <= QUANT_ONE_PASS_MAX_K and m <= QUANT_FEW_ROWS)
        block_k = triton.next_power_of_2(max(k, 16)) if one_pass else 1024
        num_warps = max(4, min(block_k // 512, current_platform().max_num_warps)) if one_pass else 4
        _quantize_per_token_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=_FP8_MAX[dtype],
                                         MIN_NORMAL=_FP8_MIN_NORMAL[dtype], ROUND_IN_SOFTWARE=triton_interpret(),
                                         ONE_PASS=one_pass, BLOCK_K=block_k,
                                         num_warps=num_warps)
    return q, scale


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


def check_ptx_decode(config: configs.GemmConfig | configs.SkinnyConfig, platform) -> None:
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
                config: configs.GemmConfig | None = None) -> torch.Tensor:
    """Launch the Triton kernel(s): x fp16 [M, K], planes uint8 [N, K] (of ``w * 2^-weight_exp``) -> fp16 [M, N]."""
    if x.dim() != 2 or x.dtype != torch.float16:
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
        skinny = configs.choose_skinny(platform.arch, mode, m, n, k, platform.num_sms)
        if skinny is not None:
            from elastiserve.kernels import skinny_gemm  # deferred: skinny_gemm imports this module at its top

            return skinny_gemm.skinny_nested(x, upper, lower, bias, nesting, mode, fnuz=fnuz, weight_exp=weight_exp,
                                             config=skinny)
        config = configs.choose_config(platform.arch, mode, m, n, k, platform.num_sms)
    if mode == "fp8" and config.block_k < 32:
        raise ConfigError(f"fp8 tl.dot needs BLOCK_K >= 32, got {config}")
    check_ptx_decode(config, platform)
    x_scale = x  # placeholder pointer when unused
    if mode == "fp8":
        x, x_scale = quantize_per_token(x, fnuz)
    out = torch.empty((m, n), dtype=torch.float16, device=x.device)
    split = config.split_k
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split)
    _nested_gemm_kernel[grid](
        x, x_scale, upper_for_kernel(upper, nesting, mode, fnuz), lower_for_kernel(upper, lower, mode),
        bias if bias is not None else x, target,
        m, n, k, triton.cdiv(triton.cdiv(k, config.block_k), split) * config.block_k,
        x.stride(0), x.stride(1), upper.stride(0), upper.stride(1), lower.stride(0), lower.stride(1),
        target.stride(0) if split > 1 else 0, target.stride(-2), target.stride(-1),
        weight_scale(nesting, mode, fnuz, weight_exp),
        MODE=MODE_IDS[mode], NESTING=int(nesting), FNUZ=fnuz, HAS_BIAS=bias is not None,
        SPLIT_K=split, SWAP_AB=config.swap_ab, EVEN_K=k % (config.block_k * split) == 0,
        PTX_DECODE=config.ptx_decode,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages, **register_cap(config),
    )
    if split > 1:
        reduce_split_k(target, bias, out)
    return out


def reduce_split_k(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out[M, N] (fp16) = sum of the contiguous fp32 partials[S, M, N] over S, plus bias."""
    split, m, n = partials.shape
    block = 1024
    _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
        partials, bias if bias is not None else out, out, m, n, SPLIT_K=split, HAS_BIAS=bias is not None,
        BLOCK=block, num_warps=4)


def fast_mode_for(m: int, *, grouped: bool = False) -> str:
    """Which fast-mode kernel this platform runs for an M-row input (``grouped``: the MoE GEMM's rows)."""
    platform = current_platform()
    min_m = 1 if grouped else FP8_MIN_M.get(platform.arch, 1)
    if platform.fast_gemm in (FastGemm.FP8_MMA, FastGemm.FP8_MMA_FNUZ) and m >= min_m:
        return "fp8"
    return "weight_only"


def _is_fnuz() -> bool:
    return current_platform().fast_gemm is FastGemm.FP8_MMA_FNUZ


def full_via_merged_weight(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, bias: torch.Tensor | None,
                           nesting: int, weight_exp: int = 0) -> torch.Tensor:
    """Full mode for many rows: decode the exact fp16 weight once into scratch, then the vendor fp16 GEMM."""
    w = merge_planes(upper, lower, nesting)  # w * 2^-weight_exp, exact
    if weight_exp == 0:
        return torch.nn.functional.linear(x, w, bias)
    y = torch.mm(x, w.t()).mul_(2.0 ** formats.check_weight_exp(weight_exp))  # power of two: exact scaling
    return y if bias is None else y.add_(bias)


@torch.library.custom_op("elastiserve::nested_linear", mutates_args=())
def nested_linear_op(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, bias: torch.Tensor | None,
                     nesting: int, fast: bool, weight_exp: int = 0) -> torch.Tensor:
    mode = fast_mode_for(x.shape[0]) if fast else "full"
    platform = current_platform()
    if platform.kernel_backend == "reference":
        return nested_linear_ref(x, upper, lower, bias, nesting, mode, fnuz=_is_fnuz(), weight_exp=weight_exp)
    if mode == "full" and configs.materializes_full(platform.arch, x.shape[0]):
        return full_via_merged_weight(x, upper, lower, bias, nesting, weight_exp)
    return nested_gemm(x, upper, lower, bias, nesting, mode, fnuz=_is_fnuz(), weight_exp=weight_exp)


@nested_linear_op.register_fake
def _(x, upper, lower, bias, nesting, fast, weight_exp=0):
    return x.new_empty((x.shape[0], upper.shape[0]))


@torch.library.custom_op("elastiserve::quantize_per_token", mutates_args=())
def quantize_per_token_op(x: torch.Tensor, fnuz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if current_platform().kernel_backend == "reference":
        return quantize_per_token_ref(x, fnuz)
    return quantize_per_token(x, fnuz)


@quantize_per_token_op.register_fake
def _(x, fnuz):
    return x.new_empty(x.shape, dtype=activation_fp8_dtype(fnuz)), x.new_empty((x.shape[0],), dtype=torch.float32)


# ---- pure-torch references ------------------------------------------------------------------------------------


def quantize_per_token_ref(x: torch.Tensor, fnuz: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = activation_fp8_dtype(fnuz)
    fp8_max = _FP8_MAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=1).clamp_min(_SCALE_FLOOR)
    # A tensor divisor, not the float: on CUDA torch turns division by a Python scalar into multiplication by its
    # reciprocal, which differed from the kernel's IEEE division in the last bit on the H200.
    scale = amax / torch.full_like(amax, fp8_max)
    q = (xf / scale[:, None]).clamp(-fp8_max, fp8_max).to(dtype)
    return q, scale


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
    w = reference_weight(upper, lower, nesting, mode, fnuz, weight_exp)
    if mode == "fp8":
        q, scale = quantize_per_token_ref(x, fnuz)
        y = (q.float() @ w.T) * scale[:, None]
    else:
        y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.float16)
