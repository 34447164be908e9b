"""Inputs and comparisons shared by the fused elementwise op tests, and the fused rotary + KV write's (CPU and CUDA)."""

from __future__ import annotations

import torch

from elastiserve.kernels.kv_ops import kv_write
from elastiserve.kernels.rms_norm import rms_norm_ref
from elastiserve.kernels.rotary import rotary_embedding


def fp16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16 values one ulp below and above each element of ``x`` (across zero too)."""
    bits = x.view(torch.int16).to(torch.int32)
    ordered = torch.where(bits < 0, -(bits & 0x7FFF), bits)

    def back(o):
        return torch.where(o < 0, (-o) | 0x8000, o).to(torch.int16).view(torch.float16)

    return back(ordered - 1), back(ordered + 1)


def assert_rms_norm_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``got`` must be ``weight`` times a normalised ``x`` that is at most 1 fp16 ulp from the reference's, rounded
    once (so a 1-ulp flip before a weight > 1 may move the output by 2 ulps, nothing else may), and equal to the
    reference for at least 99% of the elements."""
    assert got.dtype == x.dtype == weight.dtype == torch.float16 and got.shape == x.shape
    normed = rms_norm_ref(x, torch.ones_like(weight), eps)  # times 1.0: the reference's value before the weight
    expected = rms_norm_ref(x, weight, eps)
    near = [(n.float() * weight.float()).half() for n in fp16_neighbours(normed)]
    allowed = (got == expected) | (got == near[0]) | (got == near[1])
    assert allowed.all(), f"{(~allowed).sum().item()} elements are not weight * (normalised x +- 1 ulp)"
    assert (got == expected).float().mean().item() >= 0.99


def qkv_split(device, tokens, q_heads, kv_heads, head_dim, dtype=torch.float16, scale=2.0):
    """q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D] as the attention layer makes them: non-contiguous views of one qkv
    row."""
    gen = torch.Generator().manual_seed(tokens * 100 + q_heads * 10 + head_dim)
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen) * scale).to(dtype).to(device)
    heads = (q_heads, kv_heads, kv_heads)
    parts = qkv.split([h * head_dim for h in heads], dim=-1)
    return tuple(x.reshape(tokens, h, head_dim) for x, h in zip(parts, heads, strict=True))


def qkv_views(device, tokens, q_heads, kv_heads, head_dim, dtype=torch.float16, scale=2.0):
    """q and k of :func:`qkv_split`."""
    return qkv_split(device, tokens, q_heads, kv_heads, head_dim, dtype, scale)[:2]


def rotary_tables(device, max_positions, head_dim):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq).float()
    return angles.cos().to(device), angles.sin().to(device)


def paged_cache(device, num_blocks, num_layers, kv_heads, block_size, head_dim, seed=0):
    """A random fp16 kv_cache whose block stride is wider than a block (a view of a larger pool, which
    ``check_kv_cache`` allows), so a kernel that assumed a contiguous cache would write the wrong bytes."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, num_layers + 1, 2, kv_heads, block_size, head_dim, generator=gen)
    return pool.half().to(device)[:, :num_layers]


def scattered_slots(device, tokens, num_slots, skip_every, seed=0):
    """``tokens`` distinct int64 slots out of ``num_slots`` in random order, every ``skip_every``-th one -1."""
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:tokens]
    slots[::skip_every] = -1
    return slots.to(device)


def rotary_then_kv_write(positions, q, k, v, cos_table, sin_table, kv_cache, layer, slot_mapping):
    """What ``rotary_kv_write`` must equal bit for bit: the two ops it fuses, one after the other."""
    q_out, k_out = rotary_embedding(positions, q, k, cos_table, sin_table)
    kv_write(kv_cache, layer, k_out, v, slot_mapping)
    return q_out
