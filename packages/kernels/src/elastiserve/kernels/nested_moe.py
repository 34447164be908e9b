"""Grouped nested-weight GEMM over expert-sorted tokens (Qwen3-MoE / Mixtral expert MLPs).

The same kernel also runs unnested fp16 experts (``grouped_gemm_fp16``, op ``elastiserve::grouped_gemm``): the
static-fp16 engine needs a grouped GEMM it can capture in a CUDA graph, which a per-expert loop over host-read
offsets is not.

``y[t] = x_sorted[t] @ W_e.T`` for the rows ``expert_offsets[e]:expert_offsets[e+1]`` of each expert ``e``, with
``W_e`` held as ``upper[E, N, K]`` / ``lower[E, N, K]`` uint8 planes, in full or fast mode (same modes as
``nested_gemm``). Routing, sorting and the weighted combine belong to the engine.

``source_rows`` (int64 [R]) makes the kernel gather its rows itself: row t of the product is ``x[source_rows[t]]``
for the unsorted tokens ``x[T, K]``. The MoE's first GEMM then never writes an R-row ``x_sorted`` (R = T * top_k:
at 4,096 tokens of Qwen3-30B-A3B, 134 MB written and read again per layer), and fast mode quantizes T rows, not R.

The tile -> expert map is built on the device by one small kernel (``build_tile_map``; ``build_tile_map_ref`` is
its torch reference, which took ~15 launches per GEMM, 1,400 per step of a 48-layer MoE model): the grid is the
static upper bound ``cdiv(T, BLOCK_M) + E`` row tiles, padding tiles run zero K iterations, so there is no host sync
and the op can be captured in a CUDA graph.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch
import triton
import triton.language as tl

from elastiserve.kernels import configs
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.fp8_activations import platform_fnuz, quantize_per_token, quantize_per_token_ref
from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.kernels.nested_gemm import (
    MODE_IDS,
    check_ptx_decode,
    fast_mode_for,
    lower_for_kernel,
    reference_weight,
    register_cap,
    upper_for_kernel,
    weight_scale,
)
from elastiserve.kernels.weight_decode import PLAIN, load_weight_tile
from elastiserve.platforms import current_platform


@triton.jit
def _nested_moe_kernel(
    x_ptr, x_scale_ptr, source_ptr, upper_ptr, lower_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    N, K,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_le, stride_ln, stride_lk, stride_om, stride_on,
    w_scale,
    MODE: tl.constexpr, NESTING: tl.constexpr, FNUZ: tl.constexpr, EVEN_K: tl.constexpr, PTX_DECODE: tl.constexpr,
    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)  # MODE PLAIN: upper_ptr is the fp16 [E, N, K] weight
    valid = expert >= 0
    expert = tl.maximum(expert, 0)
    row_start = tl.load(tile_row_ptr + tile)
    row_end = tl.load(offsets_ptr + expert + 1)
    k_len = tl.where(valid, K, 0)  # padding tiles loop zero times and store nothing

    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = (offs_m < row_end) & valid
    mask_n = offs_n < N
    # The rows of x this tile multiplies (x is the unsorted tokens when GATHER). int32 like offs_m: rows * K stays far
    # below 2^31 at serving sizes, and the full-mode tiles already sit at 246-255 registers (configs' compile report).
    if GATHER:
        x_rows = tl.load(source_ptr + offs_m, mask=mask_m, other=0).to(tl.int32)
    else:
        x_rows = offs_m
    w_base = upper_ptr + expert.to(tl.int64) * stride_we
    l_base = lower_ptr + expert.to(tl.int64) * stride_le

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # swap-AB: experts see few tokens each
    for k in range(0, k_len, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        if EVEN_K:
            w_mask = mask_n[:, None]
            x_mask = mask_m[None, :]
        else:
            w_mask = mask_n[:, None] & mask_k[None, :]
            x_mask = mask_m[None, :] & mask_k[:, None]
        w = load_weight_tile(w_base, l_base, offs_n, offs_k, stride_wn, stride_wk, stride_ln, stride_lk, w_mask,
                             MODE, NESTING, FNUZ, PTX_DECODE)
        xt = tl.load(x_ptr + x_rows[None, :] * stride_xm + offs_k[:, None] * stride_xk, mask=x_mask, other=0.0)
        acc = tl.dot(w, xt, acc)

    acc = tl.trans(acc)
    if MODE == 2:
        x_scale = tl.load(x_scale_ptr + x_rows, mask=mask_m, other=0.0)
        acc = acc * (x_scale[:, None] * w_scale)
    else:
        acc = acc * w_scale  # 2^weight_exp, shared by the layer's experts: exact
    out_off = offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptr + out_off, acc.to(tl.float16), mask=mask_m[:, None] & mask_n[None, :])


# max_tiles changes with every token count; specialized (Triton keys ints on == 1 and % 16), a count that warm-up did
# not meet would compile a second variant mid-run.
@triton.jit(do_not_specialize=["max_tiles"])
def _tile_map_kernel(offsets_ptr, tile_expert_ptr, tile_row_ptr, max_tiles,
                     NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):
    # Each program maps BLOCK_T tile indices; every program recomputes the E-long tile prefix sum (E <= a few
    # hundred), which is cheaper than a second launch.
    wait_for_prior_grid(PDL)
    experts = tl.arange(0, EXPERTS_POW2)
    in_range = experts < NUM_EXPERTS
    start = tl.load(offsets_ptr + experts, mask=in_range, other=0).to(tl.int32)
    end = tl.load(offsets_ptr + experts + 1, mask=in_range, other=0).to(tl.int32)
    tiles = tl.where(in_range, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.cumsum(tiles, 0)
    index = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    expert = tl.sum((tile_ends[None, :] <= index[:, None]).to(tl.int32), axis=1)  # experts whose tiles end <= index
    mine = experts[None, :] == expert[:, None]
    first_tile = tl.sum(tl.where(mine, (tile_ends - tiles)[None, :], 0), axis=1)
    row_start = tl.sum(tl.where(mine, start[None, :], 0), axis=1) + (index - first_tile) * BLOCK_M
    valid = expert < NUM_EXPERTS
    store = index < max_tiles
    tl.store(tile_expert_ptr + index, tl.where(valid, expert, -1), mask=store)
    tl.store(tile_row_ptr + index, tl.where(valid, row_start, 0), mask=store)


TILE_MAP_BLOCK = 64


def build_tile_map(expert_offsets: torch.Tensor, num_tokens: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_expert, tile_row_start) int32 of static length cdiv(T, block_m) + E; expert -1 (row 0) marks padding."""
    num_experts = expert_offsets.numel() - 1
    max_tiles = triton.cdiv(num_tokens, block_m) + num_experts
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=expert_offsets.device)
    tile_row = torch.empty(max_tiles, dtype=torch.int32, device=expert_offsets.device)
    _tile_map_kernel[(triton.cdiv(max_tiles, TILE_MAP_BLOCK),)](
        expert_offsets, tile_expert, tile_row, max_tiles,
        NUM_EXPERTS=num_experts, EXPERTS_POW2=triton.next_power_of_2(num_experts), BLOCK_M=block_m,
        BLOCK_T=TILE_MAP_BLOCK, **pdl_options()
    )
    return tile_expert, tile_row


def _check_grouped(x_sorted: torch.Tensor, weight_shape: torch.Size, expert_offsets: torch.Tensor,
                   source_rows: torch.Tensor | None = None) -> None:
    num_experts, _, k = weight_shape
    if expert_offsets.shape != (num_experts + 1,) or x_sorted.shape[1] != k:
        raise ValueError(f"shapes disagree: x {tuple(x_sorted.shape)}, weight {tuple(weight_shape)}, "
                         f"offsets {tuple(expert_offsets.shape)}")
    if source_rows is not None and (source_rows.dim() != 1 or source_rows.dtype != torch.int64):
        raise ValueError(f"source_rows must be int64 [R], got {source_rows.dtype} {tuple(source_rows.shape)}")


def product_rows(x: torch.Tensor, source_rows: torch.Tensor | None) -> int:
    """Rows of the grouped product: one per source row when the kernel gathers, else x's."""
    return x.shape[0] if source_rows is None else source_rows.shape[0]


def _grouped_config(mode: str, t: int, weight_shape: torch.Size) -> configs.GemmConfig:
    # Rows per expert, not T, decide the tile: with top-k routing an expert sees about T / E * k rows.
    num_experts, n, k = weight_shape
    platform = current_platform()
    return configs.choose_grouped_config(platform.arch, mode, max(1, t // num_experts), n, k, platform.num_sms)


def _launch_grouped(x: torch.Tensor, x_scale: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                    expert_offsets: torch.Tensor, out: torch.Tensor, w_scale: float, config: configs.GemmConfig,
                    mode_id: int, nesting: int, fnuz: bool, source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The one launch of ``_nested_moe_kernel`` (``lower`` is never read in modes that have no lower plane)."""
    _, n, k = upper.shape
    tile_expert, tile_row = build_tile_map(expert_offsets, out.shape[0], config.block_m)
    _nested_moe_kernel[(tile_expert.numel(), triton.cdiv(n, config.block_n))](
        x, x_scale, source_rows if source_rows is not None else expert_offsets, upper, lower, out, tile_expert,
        tile_row, expert_offsets,
        n, k,
        x.stride(0), x.stride(1), upper.stride(0), upper.stride(1), upper.stride(2),
        lower.stride(0), lower.stride(1), lower.stride(2), out.stride(0), out.stride(1),
        w_scale,
        MODE=mode_id, NESTING=nesting, FNUZ=fnuz, EVEN_K=k % config.block_k == 0, PTX_DECODE=config.ptx_decode,
        GATHER=source_rows is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **register_cap(config), **pdl_options()
    )
    return out


def nested_moe_gemm(x_sorted: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, expert_offsets: torch.Tensor,
                    nesting: int, mode: str, *, fnuz: bool = False, weight_exp: int = 0,
                    config: configs.GemmConfig | None = None, source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the grouped kernel: x_sorted fp16 [T, K], planes uint8 [E, N, K], offsets int32 [E+1] -> [T, N]
    (with ``source_rows`` [R]: x is unsorted, row t of the product is ``x[source_rows[t]]``, -> [R, N]).

    ``weight_exp``: the planes hold ``w * 2^-weight_exp`` (one exponent for all experts of the tensor)."""
    if x_sorted.dim() != 2 or x_sorted.dtype != torch.float16:
        raise ValueError(f"x_sorted must be 2-D fp16, got {tuple(x_sorted.shape)} {x_sorted.dtype}")
    if upper.dim() != 3 or upper.shape != lower.shape or upper.dtype != torch.uint8 or lower.dtype != torch.uint8:
        raise ValueError("upper and lower must be uint8 [E, N, K] planes of one shape")
    _check_grouped(x_sorted, upper.shape, expert_offsets, source_rows)
    out = torch.empty((product_rows(x_sorted, source_rows), upper.shape[1]), dtype=torch.float16,
                      device=x_sorted.device)
    if out.shape[0] == 0:
        return out
    if config is None:
        config = _grouped_config(mode, out.shape[0], upper.shape)
    check_ptx_decode(config, current_platform())
    x, x_scale = x_sorted, x_sorted
    if mode == "fp8":  # per token: with source_rows, each of the T tokens once, its scale gathered with its row
        x, x_scale = quantize_per_token(x_sorted, fnuz)
    return _launch_grouped(x, x_scale, upper_for_kernel(upper, nesting, mode, fnuz),
                           lower_for_kernel(upper, lower, mode), expert_offsets, out,
                           weight_scale(nesting, mode, fnuz, weight_exp), config, MODE_IDS[mode], int(nesting), fnuz,
                           source_rows)


def grouped_gemm_fp16(x_sorted: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor,
                      config: configs.GemmConfig | None = None,
                      source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped kernel on plain fp16 experts: x_sorted fp16 [T, K], weight fp16 [E, N, K] -> [T, N] (rows
    gathered by ``source_rows`` as in ``nested_moe_gemm``)."""
    if x_sorted.dim() != 2 or x_sorted.dtype != torch.float16 or weight.dim() != 3 or weight.dtype != torch.float16:
        raise ValueError(f"need fp16 x_sorted [T, K] and weight [E, N, K], got {tuple(x_sorted.shape)} "
                         f"{x_sorted.dtype} and {tuple(weight.shape)} {weight.dtype}")
    _check_grouped(x_sorted, weight.shape, expert_offsets, source_rows)
    out = torch.empty((product_rows(x_sorted, source_rows), weight.shape[1]), dtype=torch.float16,
                      device=x_sorted.device)
    if out.shape[0] == 0:
        return out
    # The plain table has no decode; a caller's config may (the probe passes full-mode tiles).
    if config is None:
        config = _grouped_config("plain", out.shape[0], weight.shape)
    else:
        config = replace(config, ptx_decode=False)
    return _launch_grouped(x_sorted, x_sorted, weight, weight, expert_offsets, out, 1.0, config, PLAIN, 0, False,
                           source_rows)


@torch.library.custom_op("elastiserve::grouped_gemm", mutates_args=())
def grouped_gemm_op(x_sorted: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor,
                    source_rows: torch.Tensor | None = None) -> torch.Tensor:
    if current_platform().kernel_backend == "reference":
        return grouped_gemm_ref(x_sorted, weight, expert_offsets, source_rows)
    return grouped_gemm_fp16(x_sorted, weight, expert_offsets, source_rows=source_rows)


@grouped_gemm_op.register_fake
def _(x_sorted, weight, expert_offsets, source_rows=None):
    return x_sorted.new_empty((product_rows(x_sorted, source_rows), weight.shape[1]))


@torch.library.custom_op("elastiserve::nested_moe", mutates_args=())
def nested_moe_op(x_sorted: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, expert_offsets: torch.Tensor,
                  nesting: int, fast: bool, weight_exp: int = 0,
                  source_rows: torch.Tensor | None = None) -> torch.Tensor:
    mode = fast_mode_for(product_rows(x_sorted, source_rows), grouped=True) if fast else "full"
    if current_platform().kernel_backend == "reference":
        return nested_moe_ref(x_sorted, upper, lower, expert_offsets, nesting, mode, fnuz=platform_fnuz(),
                              weight_exp=weight_exp, source_rows=source_rows)
    return nested_moe_gemm(x_sorted, upper, lower, expert_offsets, nesting, mode, fnuz=platform_fnuz(),
                           weight_exp=weight_exp, source_rows=source_rows)


@nested_moe_op.register_fake
def _(x_sorted, upper, lower, expert_offsets, nesting, fast, weight_exp=0, source_rows=None):
    return x_sorted.new_empty((product_rows(x_sorted, source_rows), upper.shape[1]))


# ---- pure-torch reference ---------------------------------------------------------------------------------------


def nested_moe_ref(x_sorted: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, expert_offsets: torch.Tensor,
                   nesting: int, mode: str, *, fnuz: bool = False, weight_exp: int = 0,
                   source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert fp32 matmul, fp16 out (reads the offsets on the host: a reference, not a graph-capturable op)."""
    n = upper.shape[1]
    if mode == "fp8":
        q, scale = quantize_per_token_ref(x_sorted, fnuz)  # per token, before the gather: the kernel's order
        xf = q.float() * scale[:, None]
    else:
        xf = x_sorted.float()
    if source_rows is not None:
        xf, x_sorted = xf[source_rows], x_sorted[source_rows]
    out = torch.zeros((x_sorted.shape[0], n), dtype=torch.float32, device=x_sorted.device)
    bounds = expert_offsets.tolist()
    for e, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            w = reference_weight(upper[e], lower[e], Nesting(nesting), mode, fnuz, weight_exp)
            out[start:end] = xf[start:end] @ w.T
    return out.to(torch.float16)


def grouped_gemm_ref(x_sorted: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor,
                     source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert fp32 matmul of plain experts, fp16 out (host-read offsets: not graph-capturable)."""
    if source_rows is not None:
        x_sorted = x_sorted[source_rows]
    out = torch.zeros((x_sorted.shape[0], weight.shape[1]), dtype=torch.float32, device=x_sorted.device)
    for e, (start, end) in enumerate(itertools.pairwise(expert_offsets.tolist())):
        if end > start:
            out[start:end] = x_sorted[start:end].float() @ weight[e].float().T
    return out.to(torch.float16)


def build_tile_map_ref(expert_offsets: torch.Tensor, num_tokens: int,
                       block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``build_tile_map`` (the same static length; padding tiles: expert -1, row 0)."""
    num_experts = expert_offsets.numel() - 1
    offsets = expert_offsets.to(torch.int64)
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    max_tiles = triton.cdiv(num_tokens, block_m) + num_experts
    index = torch.arange(max_tiles, device=expert_offsets.device)
    expert = torch.searchsorted(tile_ends, index, right=True)
    valid = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    first_tile = tile_ends[expert] - tiles[expert]
    row_start = offsets[expert] + (index - first_tile) * block_m
    tile_expert = torch.where(valid, expert, torch.full_like(expert, -1))
    return tile_expert.to(torch.int32), torch.where(valid, row_start, 0).to(torch.int32)
