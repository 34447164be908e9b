"""Paged KV cache writes and ElasticKV pair transitions (TARGET <-> BASE) as ``elastiserve::`` custom ops.

Cache layout (ARCHITECTURE.md): ``kv_cache[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`` fp16,
one tensor for the whole pool. A BASE pair is packed in place into its block A as
``packed = (rna(A) << 8) | rna(B)``, with ``rna`` the high byte rounded half away from zero; the low bytes
``lowA || lowB`` go to a staging buffer so that promotion restores TARGET bit-exactly.

Every op runs Triton when ``current_platform().kernel_backend == "triton"`` and the pure-torch ``*_ref`` otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.platforms import current_platform
from elastiserve.platforms.errors import ElastiserveError


class KVLayoutError(ElastiserveError, ValueError):
    """A tensor handed to a KV op does not have the layout the op needs."""


DEMOTE_BLOCK = 2048  # elements per program; a multiple of every realistic per-block element count's factors


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 6 or kv_cache.dtype != torch.float16 or kv_cache.shape[2] != 2:
        raise KVLayoutError(
            f"kv_cache must be fp16 [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim], got "
            f"{kv_cache.dtype} {tuple(kv_cache.shape)}"
        )
    if not kv_cache[0].is_contiguous():
        raise KVLayoutError("kv_cache must be contiguous within a block (only the block stride may be larger)")


def elements_per_block(kv_cache: torch.Tensor) -> int:
    return kv_cache[0].numel()


def _use_triton() -> bool:
    return current_platform().kernel_backend == "triton"


# ----------------------------------------------------------------------------------------------- kv_write


@triton.jit
def _kv_write_kernel(
    kv_ptr,  # fp16 kv_cache base, already offset to this layer's K plane
    key_ptr,  # [T, H, D]
    value_ptr,  # [T, H, D]
    slot_ptr,  # [T] int64
    stride_block,
    stride_kv,
    stride_head,
    stride_tok,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_prior_grid(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (dims < head_dim)
        key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        dst = kv_ptr + block * stride_block + offset * stride_tok + heads * stride_head + dims
        tl.store(dst, key, mask=mask)
        tl.store(dst + stride_kv, value, mask=mask)


def _kv_write_triton(kv_cache, layer, key, value, slot_mapping) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    layer_view = kv_cache[:, layer]  # [N, 2, H, BS, D]
    _kv_write_kernel[(num_tokens,)](
        layer_view, key, value, slot_mapping,
        layer_view.stride(0), layer_view.stride(1), layer_view.stride(2), layer_view.stride(3),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        num_heads, head_dim,
        BLOCK_SIZE=kv_cache.shape[4],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), **pdl_options()
    )  # fmt: skip


@torch.library.custom_op("elastiserve::kv_write", mutates_args=("kv_cache",))
def kv_write(
    kv_cache: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping[T]`` (int64,
    ``phys_block * block_size + offset``; a negative slot skips the token)."""
    check_kv_cache(kv_cache)
    if _use_triton():
        _kv_write_triton(kv_cache, layer, key, value, slot_mapping)
    else:
        kv_write_ref(kv_cache, layer, key, value, slot_mapping)


@kv_write.register_fake
def _(kv_cache, layer, key, value, slot_mapping) -> None:
    return None


# ------------------------------------------------------------------------------------- demote / promote


@triton.jit
def _kv_demote_kernel(
    kv_ptr,  # fp16 kv_cache base
    blocks_a_ptr,  # [P] int64
    blocks_b_ptr,  # [P] int64
    low_ptr,  # [P, 2n] uint8
    stride_block,
    n,  # elements per block
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src_a = kv_ptr + tl.load(blocks_a_ptr + pair) * stride_block + offs
    src_b = kv_ptr + tl.load(blocks_b_ptr + pair) * stride_block + offs
    a = tl.load(src_a, mask=mask).to(tl.uint16, bitcast=True)
    b = tl.load(src_b, mask=mask).to(tl.uint16, bitcast=True)
    # rna: high byte rounded half away from zero on the magnitude bits; wraps mod 256, never saturates.
    hi_a = ((a >> 8) + ((a & 0xFF) >> 7)) & 0xFF
    hi_b = ((b >> 8) + ((b & 0xFF) >> 7)) & 0xFF
    packed = (hi_a << 8) | hi_b
    # Same program reads and writes element i of block A: no other program touches it, so in place is safe.
    tl.store(src_a, packed.to(tl.float16, bitcast=True), mask=mask)
    low_row = low_ptr + pair * (2 * n)
    tl.store(low_row + offs, (a & 0xFF).to(tl.uint8), mask=mask)
    tl.store(low_row + n + offs, (b & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _kv_promote_kernel(
    kv_ptr,
    packed_ptr,  # [P] int64
    dst_a_ptr,  # [P] int64
    dst_b_ptr,  # [P] int64
    low_ptr,  # [P, 2n] uint8
    stride_block,
    n,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    packed = tl.load(kv_ptr + tl.load(packed_ptr + pair) * stride_block + offs, mask=mask).to(tl.uint16, bitcast=True)
    low_row = low_ptr + pair * (2 * n)
    low_a = tl.load(low_row + offs, mask=mask).to(tl.uint16)
    low_b = tl.load(low_row + n + offs, mask=mask).to(tl.uint16)
    # Undo the rounding carry: the low byte's top bit says whether rna added one.
    hi_a = ((packed >> 8) - (low_a >> 7)) & 0xFF
    hi_b = ((packed & 0xFF) - (low_b >> 7)) & 0xFF
    a = (hi_a << 8) | low_a
    b = (hi_b << 8) | low_b
    tl.store(kv_ptr + tl.load(dst_a_ptr + pair) * stride_block + offs, a.to(tl.float16, bitcast=True), mask=mask)
    tl.store(kv_ptr + tl.load(dst_b_ptr + pair) * stride_block + offs, b.to(tl.float16, bitcast=True), mask=mask)


def _check_pairs(kv_cache: torch.Tensor, low: torch.Tensor, *block_lists: torch.Tensor) -> int:
    check_kv_cache(kv_cache)
    n = elements_per_block(kv_cache)
    num_pairs = block_lists[0].shape[0]
    for blocks in block_lists:
        if blocks.dtype != torch.int64 or blocks.shape != (num_pairs,):
            raise KVLayoutError(f"block lists must be int64 [{num_pairs}], got {blocks.dtype} {tuple(blocks.shape)}")
    if low.dtype != torch.uint8 or tuple(low.shape) != (num_pairs, 2 * n) or not low.is_contiguous():
        raise KVLayoutError(f"low bytes must be contiguous uint8 [{num_pairs}, {2 * n}], got {tuple(low.shape)}")
    return n


def _pair_grid(num_pairs: int, n: int) -> tuple[int, int]:
    return (num_pairs, triton.cdiv(n, DEMOTE_BLOCK))


@torch.library.custom_op("elastiserve::kv_demote", mutates_args=("kv_cache", "low_out"))
def kv_demote(kv_cache: torch.Tensor, blocks_a: torch.Tensor, blocks_b: torch.Tensor, low_out: torch.Tensor) -> None:
    """Pack each pair (``blocks_a[P]``, ``blocks_b[P]``) in place into block A (every layer) and write the low
    bytes ``lowA || lowB`` to ``low_out[P, 2n]`` (uint8, n = elements per block)."""
    n = _check_pairs(kv_cache, low_out, blocks_a, blocks_b)
    if blocks_a.shape[0] == 0:
        return
    if _use_triton():
        grid = _pair_grid(blocks_a.shape[0], n)
        _kv_demote_kernel[grid](kv_cache, blocks_a, blocks_b, low_out, kv_cache.stride(0), n, BLOCK=DEMOTE_BLOCK)
    else:
        kv_demote_ref(kv_cache, blocks_a, blocks_b, low_out)


@kv_demote.register_fake
def _(kv_cache, blocks_a, blocks_b, low_out) -> None:
    return None


@torch.library.custom_op("elastiserve::kv_promote", mutates_args=("kv_cache",))
def kv_promote(
    kv_cache: torch.Tensor, packed: torch.Tensor, dst_a: torch.Tensor, dst_b: torch.Tensor, low_in: torch.Tensor
) -> None:
    """Restore TARGET bit-exactly from the packed blocks ``packed[P]`` and ``low_in[P, 2n]`` into the fresh
    blocks ``dst_a[P]``, ``dst_b[P]``."""
    n = _check_pairs(kv_cache, low_in, packed, dst_a, dst_b)
    if packed.shape[0] == 0:
        return
    if _use_triton():
        grid = _pair_grid(packed.shape[0], n)
        _kv_promote_kernel[grid](kv_cache, packed, dst_a, dst_b, low_in, kv_cache.stride(0), n, BLOCK=DEMOTE_BLOCK)
    else:
        kv_promote_ref(kv_cache, packed, dst_a, dst_b, low_in)


@kv_promote.register_fake
def _(kv_cache, packed, dst_a, dst_b, low_in) -> None:
    return None


# ------------------------------------------------------------------------------------ pure-torch references


def fp16_bits(x: torch.Tensor) -> torch.Tensor:
    """The uint16 bit pattern of fp16 ``x`` as int32 in [0, 65535]."""
    return x.view(torch.int16).to(torch.int32) & 0xFFFF


def fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp16_bits` (``bits`` int32 in [0, 65535])."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    return signed.to(torch.int16).view(torch.float16)


def rna_high_byte(bits: torch.Tensor) -> torch.Tensor:
    return ((bits >> 8) + ((bits & 0xFF) >> 7)) & 0xFF


def base_halves(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical blocks (A, B) that a packed fp16 tensor stands for: exact E5M2 values as fp16."""
    bits = fp16_bits(packed)
    return fp16_from_bits(bits & 0xFF00), fp16_from_bits((bits << 8) & 0xFF00)


def e5m2_round(x: torch.Tensor) -> torch.Tensor:
    """What BASE makes of fp16 ``x``: its rna high byte, read back as fp16."""
    return fp16_from_bits(rna_high_byte(fp16_bits(x)) << 8)


def kv_write_ref(kv_cache, layer, key, value, slot_mapping) -> None:
    block_size = kv_cache.shape[4]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, layer, 0, :, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[blocks, layer, 1, :, offsets] = value[keep].to(kv_cache.dtype)


def kv_demote_ref(kv_cache, blocks_a, blocks_b, low_out) -> None:
    num_pairs = blocks_a.shape[0]
    a = fp16_bits(kv_cache[blocks_a]).reshape(num_pairs, -1)
    b = fp16_bits(kv_cache[blocks_b]).reshape(num_pairs, -1)
    packed = (rna_high_byte(a) << 8) | rna_high_byte(b)
    kv_cache[blocks_a] = fp16_from_bits(packed).reshape(kv_cache[blocks_a].shape)
    low_out.copy_(torch.cat([a & 0xFF, b & 0xFF], dim=1).to(torch.uint8))


def kv_promote_ref(kv_cache, packed, dst_a, dst_b, low_in) -> None:
    num_pairs, n = packed.shape[0], low_in.shape[1] // 2
    block_shape = kv_cache.shape[1:]
    words = fp16_bits(kv_cache[packed]).reshape(num_pairs, n)
    low = low_in.to(torch.int32)
    low_a, low_b = low[:, :n], low[:, n:]
    a = ((((words >> 8) - (low_a >> 7)) & 0xFF) << 8) | low_a
    b = ((((words & 0xFF) - (low_b >> 7)) & 0xFF) << 8) | low_b
    # Compute both before writing: dst_a may be the packed block itself.
    kv_cache[dst_a] = fp16_from_bits(a).reshape(num_pairs, *block_shape)
    kv_cache[dst_b] = fp16_from_bits(b).reshape(num_pairs, *block_shape)
