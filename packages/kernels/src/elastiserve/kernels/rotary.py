"""Neox-style (rotate-half) rotary embedding of q and k in one launch, as the ``elastiserve::rotary_embedding`` op.

For each token t at position p and each head: ``(x1, x2) = halves of x[t, h]`` in fp32,
``out = (x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p])`` cast back to x's dtype. Unfused this is ~12 torch
ops for q and again for k (table gathers, chunk, four products, two sums, cat, casts); here it is one kernel that
reads q and k straight out of the qkv projection's split views.

``elastiserve::rotary_kv_write`` is the same rotation fused with ``kv_write``: the programs that rotate k heads store
them, and the v heads beside them, straight into the paged cache, so a layer launches one kernel for both (and never
materializes the rotated k). Its bytes equal ``rotary_embedding`` followed by ``kv_write``: the rotation is the same
``_rotate_heads``.

Runs Triton when ``current_platform().kernel_backend == "triton"`` and the pure-torch ``*_ref`` otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastiserve.kernels.kv_ops import KVLayoutError, check_kv_cache, kv_write_ref
from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.kernels.rms_norm import ElementwiseShapeError
from elastiserve.platforms import current_platform

TILE_ELEMENTS = 1024  # heads * half-dim per program: 16 heads of dim 128, so 3 programs per Llama-8B token


@triton.jit
def _table_rows(cos_ptr, sin_ptr, position, stride_table, half_dim, BLOCK_HALF: tl.constexpr):
    """The cos and sin rows of ``position``, each [1, BLOCK_HALF] fp32."""
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + position * stride_table + dims, mask=dims < half_dim, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + dims, mask=dims < half_dim, other=0.0)
    return cos, sin


@triton.jit
def _rotate_heads(
    x_ptr,  # [T, H, D], last dim contiguous
    out_row_ptr,  # this token's [H, D] output rows, last dim contiguous
    token,
    first_head,
    num_heads,
    stride_t,
    stride_h,
    stride_out_h,
    cos,  # [1, BLOCK_HALF] fp32
    sin,
    half_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = first_head + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half_dim)
    src = x_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half_dim, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    dst = out_row_ptr + heads * stride_out_h + dims
    tl.store(dst, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(dst + half_dim, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_out_ptr,  # [T, Hq, D] contiguous
    k_out_ptr,  # [T, Hk, D] contiguous
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hk, D]
    positions_ptr,  # [T] int32 or int64
    cos_ptr,  # [max_pos, D / 2] fp32
    sin_ptr,  # [max_pos, D / 2] fp32
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_table,
    num_q_heads,
    num_k_heads,
    half_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False,
):
    # Grid (T, q head blocks + k head blocks): one launch serves both, and a batch-1 decode still spreads over SMs.
    wait_for_prior_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    head_dim = 2 * half_dim
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos, sin = _table_rows(cos_ptr, sin_ptr, position, stride_table, half_dim, BLOCK_HALF)
    if head_block < q_blocks:
        _rotate_heads(q_ptr, q_out_ptr + token * num_q_heads * head_dim, token, head_block * BLOCK_H, num_q_heads,
                      stride_qt, stride_qh, head_dim, cos, sin, half_dim, BLOCK_H, BLOCK_HALF)  # fmt: skip
    else:
        _rotate_heads(k_ptr, k_out_ptr + token * num_k_heads * head_dim, token, (head_block - q_blocks) * BLOCK_H,
                      num_k_heads, stride_kt, stride_kh, head_dim, cos, sin, half_dim, BLOCK_H, BLOCK_HALF)  # fmt: skip


def _rotary_triton(positions, q, k, cos_table, sin_table) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = max(1, min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), TILE_ELEMENTS // block_half))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h))
    _rotary_kernel[grid](
        q_out, k_out, q, k, positions, cos_table, sin_table,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_table.stride(0),
        num_q_heads, num_k_heads, head_dim // 2,
        BLOCK_H=block_h, BLOCK_HALF=block_half, **pdl_options()
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def _rotary_kv_write_kernel(
    q_out_ptr,  # [T, Hq, D] contiguous
    kv_ptr,  # fp16 kv_cache base, already offset to this layer's K plane
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    positions_ptr,  # [T] int32 or int64
    slot_ptr,  # [T] int64
    cos_ptr,  # [max_pos, D / 2] fp32
    sin_ptr,  # [max_pos, D / 2] fp32
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_table,
    stride_block,
    stride_kv,
    stride_head,
    stride_tok,
    num_q_heads,
    num_kv_heads,
    half_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False,
):
    # Grid (T, q head blocks + kv head blocks) as _rotary_kernel's; a kv program also moves its v heads, so v costs
    # no program of its own.
    wait_for_prior_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_HQ)
    head_dim = 2 * half_dim
    position = tl.load(positions_ptr + token).to(tl.int64)
    if head_block < q_blocks:
        cos, sin = _table_rows(cos_ptr, sin_ptr, position, stride_table, half_dim, BLOCK_HALF)
        _rotate_heads(q_ptr, q_out_ptr + token * num_q_heads * head_dim, token, head_block * BLOCK_HQ, num_q_heads,
                      stride_qt, stride_qh, head_dim, cos, sin, half_dim, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    else:
        # The slot is loaded while the position is still in flight, and the tables only once it says the token is
        # kept: two dependent loads deep, like the q programs.
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            cos, sin = _table_rows(cos_ptr, sin_ptr, position, stride_table, half_dim, BLOCK_HALF)
            first_head = (head_block - q_blocks) * BLOCK_HKV
            k_row = kv_ptr + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_tok
            _rotate_heads(k_ptr, k_row, token, first_head, num_kv_heads, stride_kt, stride_kh, stride_head,
                          cos, sin, half_dim, BLOCK_HKV, BLOCK_HALF)  # fmt: skip
            heads = first_head + tl.arange(0, BLOCK_HKV)[:, None]
            dims = tl.arange(0, 2 * BLOCK_HALF)[None, :]
            mask = (heads < num_kv_heads) & (dims < head_dim)
            value = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
            tl.store(k_row + stride_kv + heads * stride_head + dims, value, mask=mask)


def _rotary_kv_write_triton(positions, q, k, v, cos_table, sin_table, kv_cache, layer, slot_mapping) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    layer_view = kv_cache[:, layer]  # [N, 2, Hkv, BS, D]
    block_half = triton.next_power_of_2(head_dim // 2)
    block_hq = max(1, min(triton.next_power_of_2(num_q_heads), TILE_ELEMENTS // block_half))
    block_hkv = max(1, min(triton.next_power_of_2(num_kv_heads), TILE_ELEMENTS // block_half))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_hq) + triton.cdiv(num_kv_heads, block_hkv))
    _rotary_kv_write_kernel[grid](
        q_out, layer_view, q, k, v, positions, slot_mapping, cos_table, sin_table,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_table.stride(0),
        layer_view.stride(0), layer_view.stride(1), layer_view.stride(2), layer_view.stride(3),
        num_q_heads, num_kv_heads, head_dim // 2,
        BLOCK_SIZE=kv_cache.shape[4], BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half, **pdl_options()
    )  # fmt: skip
    return q_out


def _check(positions, q, k, cos_table, sin_table) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or k.dtype != q.dtype:
        raise ElementwiseShapeError(
            f"rotary q and k must be [T, H, D] of one dtype, same T and D; got q {q.dtype} {tuple(q.shape)}, "
            f"k {k.dtype} {tuple(k.shape)}"
        )
    half = q.shape[2] // 2
    if q.shape[2] % 2 or positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ElementwiseShapeError(
            f"rotary needs an even head dim and int positions [T]; got D={q.shape[2]}, positions {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    for table in (cos_table, sin_table):
        if table.dim() != 2 or table.shape[1] != half or table.dtype != torch.float32:
            raise ElementwiseShapeError(f"rotary tables must be fp32 [max_pos, {half}], got {table.dtype} "
                                        f"{tuple(table.shape)}")  # fmt: skip


@torch.library.custom_op("elastiserve::rotary_embedding", mutates_args=())
def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q[T, Hq, D]`` and ``k[T, Hk, D]`` (any strides, e.g. views of a qkv split) at ``positions[T]``.

    ``cos_table`` / ``sin_table``: fp32 ``[max_pos, D / 2]``; positions must be below ``max_pos`` (not checked:
    that would read them back to the host). Returns contiguous ``(q_out, k_out)`` in q's dtype.
    """
    _check(positions, q, k, cos_table, sin_table)
    if current_platform().kernel_backend == "triton":
        return _rotary_triton(positions, q, k, cos_table, sin_table)
    return rotary_embedding_ref(positions, q, k, cos_table, sin_table)


@rotary_embedding.register_fake
def _(positions, q, k, cos_table, sin_table):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _check_kv(k, v, kv_cache, layer, slot_mapping) -> None:
    check_kv_cache(kv_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise KVLayoutError(f"v must be shaped and typed like k {k.dtype} {tuple(k.shape)}, got {v.dtype} "
                            f"{tuple(v.shape)}")  # fmt: skip
    if kv_cache.shape[3] != num_kv_heads or kv_cache.shape[5] != head_dim or not 0 <= layer < kv_cache.shape[1]:
        raise KVLayoutError(f"k [T, {num_kv_heads}, {head_dim}] and layer {layer} do not fit kv_cache "
                            f"{tuple(kv_cache.shape)}")  # fmt: skip
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise KVLayoutError(f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} "
                            f"{tuple(slot_mapping.shape)}")  # fmt: skip


@torch.library.custom_op("elastiserve::rotary_kv_write", mutates_args=("kv_cache",))
def rotary_kv_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``rotary_embedding`` of q and k, then ``kv_write`` of the rotated k and of v, in one launch; returns the
    rotated q (contiguous ``[T, Hq, D]``).

    q, k, v: ``[T, H, D]`` of one dtype, any strides (views of a qkv split); the tables as for ``rotary_embedding``;
    ``slot_mapping[T]`` int64 as for ``kv_write`` (a negative slot skips the token).
    """
    _check(positions, q, k, cos_table, sin_table)
    _check_kv(k, v, kv_cache, layer, slot_mapping)
    if current_platform().kernel_backend == "triton":
        return _rotary_kv_write_triton(positions, q, k, v, cos_table, sin_table, kv_cache, layer, slot_mapping)
    return rotary_kv_write_ref(positions, q, k, v, cos_table, sin_table, kv_cache, layer, slot_mapping)


@rotary_kv_write.register_fake
def _(positions, q, k, v, cos_table, sin_table, kv_cache, layer, slot_mapping):
    return q.new_empty(q.shape)


# ------------------------------------------------------------------------------------ pure-torch reference


def rotate_ref(positions: torch.Tensor, x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor):
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rotate_ref(positions, q, cos_table, sin_table), rotate_ref(positions, k, cos_table, sin_table)


def rotary_kv_write_ref(positions, q, k, v, cos_table, sin_table, kv_cache, layer, slot_mapping) -> torch.Tensor:
    q_out, k_out = rotary_embedding_ref(positions, q, k, cos_table, sin_table)
    kv_write_ref(kv_cache, layer, k_out, v, slot_mapping)
    return q_out
