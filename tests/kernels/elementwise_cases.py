"""Inputs and comparisons shared by the fused elementwise op tests (CPU and CUDA)."""

from __future__ import annotations

import torch

from elastiserve.kernels.rms_norm import rms_norm_ref


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


def qkv_views(device, tokens, q_heads, kv_heads, head_dim, dtype=torch.float16, scale=2.0):
    """q[T, Hq, D], k[T, Hkv, D] as the attention layer makes them: non-contiguous views of one qkv row."""
    gen = torch.Generator().manual_seed(tokens * 100 + q_heads * 10 + head_dim)
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen) * scale).to(dtype).to(device)
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.reshape(tokens, q_heads, head_dim), k.reshape(tokens, kv_heads, head_dim)


def rotary_tables(device, max_positions, head_dim):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq).float()
    return angles.cos().to(device), angles.sin().to(device)
