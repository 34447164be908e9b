"""fp8 activations for fast mode's fp8 GEMMs: dynamic per-token E4M3 quantization, alone and as a row helper that
the quantizing norms and SiLU-and-mul share.

``quantize_per_token`` (op ``elastiserve::quantize_per_token``) turns fp16 rows x[M, K] into (q fp8 [M, K], scale fp32
[M]) with ``x ~ q * scale``: scale = max(|row|, 1e-8) / FP8_MAX by IEEE division, q = x / scale clamped and rounded
to nearest even. ``quantize_row`` is the same math on a row held in registers, so a kernel that has just computed a
row (``rms_norm.py``, ``silu_mul.py``) writes the fp8 row and its scale itself and the separate quantizer launch (2-5
us at decode sizes on the H200) goes away; the bytes equal the quantizer's on that kernel's fp16 output. Pure-torch
reference: ``quantize_per_token_ref``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.platforms import FastGemm, current_platform
from elastiserve.platforms.env import triton_interpret

# A row is quantized from registers in one read of x (up to 16 warps: 32 fp32 values a thread) when it is short, or
# when there are few rows; else a loop over 1,024-wide chunks reads it twice (4 warps, one program a row). On the
# H200 (session 16, benchmarks/kernels/results/h200-vendor-fp8-s16.json and h200-fp8-tiles-s16.json): K = 4096 one
# pass 2.2 us at 16-64 rows and 19.4 us at 4,096 rows against 3.1 / 21.5 us for the loop; K = 14336 one pass 5.1 us
# at 32-128 rows against 9.0 us, but 16.5 / 38.8 / 178.8 us at 512 / 1,024 / 4,096 rows against the loop's 10.0 /
# 17.4 / 88.9 us (512-thread programs holding a whole row: too few resident to hide the load's latency).
QUANT_ONE_PASS_MAX_K = 16384
QUANT_SHORT_K, QUANT_FEW_ROWS = 4096, 128
# Rows longer than QUANT_SHORT_K, at (low, high) rows per arch, spread over SPLIT_BLOCK-wide programs in two launches
# (each chunk's max |x|, then the row scale from those maxima and the chunk's codes) instead of one program a row.
# Why: one 4-warp program a row leaves 8 warps a SM at 256 rows, each walking its 14,336 values twice; on the H200 the
# down GEMM at 256 rows ran 50.9 us in fast mode with its rows quantized in the op against 34.8 on rows quantized
# beforehand (session 37, benchmarks/kernels/results/h200-nested-gemm-s37.json). Measured on an H100 (session 39,
# ci/gpu/quant_split_round.sh, raw benchmarks/kernels/results/h100-quant-split-s39-*): the split quantizer is 1.06-1.54x
# the one-program route at 16-256 rows and 0.69-0.88x at 512-4,096 (K 12,288 and 14,336); through the op the down GEMM
# in fast mode runs 1-13 % faster at 2-256 rows (Llama-3.1-8B at 256: 56.1 -> 50.2 us) and 4-6 % slower at 1,024 with
# the split on there. Not yet timed on an H200 (same sm90 table).
QUANT_SPLIT_ROWS: dict[str, tuple[int, int]] = {"sm90": (2, 256)}
SPLIT_BLOCK = 1024
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
_FP8_MIN_NORMAL = {torch.float8_e4m3fn: 2.0**-6, torch.float8_e4m3fnuz: 2.0**-7}
_SCALE_FLOOR = 1e-8


@triton.jit
def to_fp8_range(x, scale, FP8_MAX: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr, MIN_NORMAL: tl.constexpr):
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
def scale_of(amax, FP8_MAX: tl.constexpr):
    """The scale of a row whose max |x| is ``amax``: floored at 1e-8, then IEEE-divided by FP8_MAX (the reference's)."""
    return tl.div_rn(tl.maximum(amax, 1e-8), FP8_MAX)


@triton.jit
def quantize_row(x, FP8_MAX: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """(q, scale) of one fp32 row held in registers (masked-off lanes must be 0): the quantizer's one-pass math."""
    scale = scale_of(tl.max(tl.abs(x), axis=0), FP8_MAX)
    return to_fp8_range(x, scale, FP8_MAX, ROUND_IN_SOFTWARE, MIN_NORMAL), scale


@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, FP8_MAX: tl.constexpr,
                               MIN_NORMAL: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr, ONE_PASS: tl.constexpr,
                               BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * stride_qm
    if ONE_PASS:  # the whole row in registers: one read of x
        offs = tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q, scale = quantize_row(x, FP8_MAX, ROUND_IN_SOFTWARE, MIN_NORMAL)
        tl.store(scale_ptr + row, scale)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            offs = k + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = scale_of(tl.max(amax, axis=0), FP8_MAX)
        tl.store(scale_ptr + row, scale)
        for k in range(0, K, BLOCK_K):
            offs = k + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = to_fp8_range(x, scale, FP8_MAX, ROUND_IN_SOFTWARE, MIN_NORMAL)
            tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


@triton.jit
def _chunk_max_kernel(chunk_max_ptr, x_ptr, K, stride_xm, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """The split quantizer's first launch: chunk_max[row, chunk] = max |x| over one BLOCK-wide chunk of a row."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    tl.store(chunk_max_ptr + row * tl.num_programs(1) + chunk, tl.max(tl.abs(x), axis=0))


@triton.jit
def _quantize_chunk_kernel(q_ptr, scale_ptr, x_ptr, chunk_max_ptr, K, stride_xm, FP8_MAX: tl.constexpr,
                          MIN_NORMAL: tl.constexpr, ROUND_IN_SOFTWARE: tl.constexpr, BLOCK: tl.constexpr,
                          CHUNKS: tl.constexpr, PDL: tl.constexpr = False):
    """The split quantizer's second launch: the row's scale from its chunk maxima (max is exact, so it is
    ``quantize_row``'s scale), then this chunk's codes; chunk 0 writes the scale. q rows are K apart."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slots = tl.arange(0, CHUNKS)
    maxima = tl.load(chunk_max_ptr + row * tl.num_programs(1) + slots, mask=slots < tl.num_programs(1), other=0.0)
    scale = scale_of(tl.max(maxima, axis=0), FP8_MAX)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    q = to_fp8_range(x, scale, FP8_MAX, ROUND_IN_SOFTWARE, MIN_NORMAL)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)


class Fp8Rows(NamedTuple):
    """Activation rows already quantized for fast mode's fp8 GEMM: what a quantizing norm or SiLU-and-mul hands a
    ``NestedLinear`` whose ``takes_fp8_rows`` said yes."""

    q: torch.Tensor  # [R, K] e4m3 (fnuz on MI300)
    scale: torch.Tensor  # [R] fp32

    @property
    def num_rows(self) -> int:
        return self.q.shape[0]


def platform_fnuz() -> bool:
    """Whether this platform's fp8 activations are E4M3 FNUZ (MI300) rather than OCP E4M3FN."""
    return current_platform().fast_gemm is FastGemm.FP8_MMA_FNUZ


def splits_quantized_rows(rows: int, k: int) -> bool:
    """Whether ``quantize_per_token`` spreads each of ``rows`` rows of ``k`` values over programs (QUANT_SPLIT_ROWS)."""
    low, high = QUANT_SPLIT_ROWS.get(current_platform().arch, (1, 0))
    return k > QUANT_SHORT_K and low <= rows <= high


def quantize_chunks(x: torch.Tensor, chunk_max: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    fnuz: bool) -> None:
    """Fill (q, scale) for rows x [R, K] whose SPLIT_BLOCK-wide chunk maxima ``chunk_max`` [R, chunks] are written
    or being written by the launch before (the split route's second launch; silu_mul's split route shares it)."""
    rows, k = x.shape
    chunks = chunk_max.shape[1]
    _quantize_chunk_kernel[(rows, chunks)](q, scale, x, chunk_max, k, x.stride(0), **fp8_constants(fnuz),
                                          BLOCK=SPLIT_BLOCK, CHUNKS=triton.next_power_of_2(chunks), **pdl_options())


def quantizes_in_one_pass(rows: int, k: int) -> bool:
    """Whether rows of K values are quantized from registers in one read (``QUANT_ONE_PASS_MAX_K`` says when)."""
    return k <= QUANT_SHORT_K or (k <= QUANT_ONE_PASS_MAX_K and rows <= QUANT_FEW_ROWS)


def activation_fp8_dtype(fnuz: bool) -> torch.dtype:
    return torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn


def fp8_constants(fnuz: bool) -> dict:
    """The constexprs every quantizing kernel takes for the activation dtype (``quantize_row``'s)."""
    dtype = activation_fp8_dtype(fnuz)
    return {"FP8_MAX": _FP8_MAX[dtype], "MIN_NORMAL": _FP8_MIN_NORMAL[dtype], "ROUND_IN_SOFTWARE": triton_interpret()}


def empty_fp8_rows(rows: int, k: int, fnuz: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (q [rows, k], scale [rows]) for a quantizing kernel to fill."""
    q = torch.empty((rows, k), dtype=activation_fp8_dtype(fnuz), device=device)
    return q, torch.empty((rows,), dtype=torch.float32, device=device)


def quantize_per_token(x: torch.Tensor, fnuz: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row e4m3 quantization: (x_fp8[M, K], scale[M] fp32) with x ~ x_fp8 * scale."""
    m, k = x.shape
    q, scale = empty_fp8_rows(m, k, fnuz, x.device)
    if m and splits_quantized_rows(m, k):
        chunk_max = torch.empty((m, triton.cdiv(k, SPLIT_BLOCK)), dtype=torch.float32, device=x.device)
        _chunk_max_kernel[chunk_max.shape](chunk_max, x, k, x.stride(0), BLOCK=SPLIT_BLOCK, **pdl_options())
        quantize_chunks(x, chunk_max, q, scale, fnuz)
    elif m:
        one_pass = quantizes_in_one_pass(m, k)
        block_k = triton.next_power_of_2(max(k, 16)) if one_pass else 1024
        _quantize_per_token_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), **fp8_constants(fnuz),
                                         ONE_PASS=one_pass, BLOCK_K=block_k,
                                         num_warps=row_warps(block_k) if one_pass else 4, **pdl_options())
    return q, scale


def row_warps(block: int) -> int:
    """Warps for a program that holds a whole row of ``block`` values: 16 fp32 values a thread, 4 warps at least and
    the vendor's cap at most (32 on NVIDIA; AMD's 16 leave 32 values a thread in a 16,384-wide row)."""
    return max(4, min(block // 512, current_platform().max_num_warps))


def check_fp8_rows(q: torch.Tensor, scale: torch.Tensor, fnuz: bool) -> None:
    """(q, scale) must be ``quantize_per_token``'s pair for the platform's activation dtype."""
    want = activation_fp8_dtype(fnuz)
    if q.dim() != 2 or q.dtype != want:
        raise ValueError(f"fp8 rows must be 2-D {want}, got {tuple(q.shape)} {q.dtype}")
    if scale.shape != (q.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"fp8 row scales must be fp32 [{q.shape[0]}], got {tuple(scale.shape)} {scale.dtype}")


@torch.library.custom_op("elastiserve::quantize_per_token", mutates_args=())
def quantize_per_token_op(x: torch.Tensor, fnuz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if current_platform().kernel_backend == "reference":
        return quantize_per_token_ref(x, fnuz)
    return quantize_per_token(x, fnuz)


@quantize_per_token_op.register_fake
def _(x, fnuz):
    return x.new_empty(x.shape, dtype=activation_fp8_dtype(fnuz)), x.new_empty((x.shape[0],), dtype=torch.float32)


# ---- pure-torch reference -------------------------------------------------------------------------------------


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
