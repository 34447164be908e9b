"""CUDA only: the grouped MoE GEMM at prefill sizes, where sm90 takes the probed large tiles (configs.py)."""

import pytest
import torch

from elastiserve.kernels import formats, nested_moe
from elastiserve.kernels.formats import Nesting

pytestmark = [pytest.mark.cuda]


def _rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def _problem(device, counts, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(len(counts), n, k, generator=gen) * 0.05).half()
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    x = torch.randn(int(offsets[-1]), k, generator=gen).half()
    upper, lower = formats.split(w, Nesting.E4M3)
    return x.to(device), w.to(device), upper.to(device), lower.to(device), offsets.to(device)


@pytest.mark.parametrize("rows", [(60, 200), (200, 330)])  # buckets 256 and 1024 of rows per expert
@pytest.mark.parametrize("mode", ["plain", "full", "fp8"])
def test_prefill_sized_groups_match_reference(device, rows, mode):
    """Prefill-sized expert groups (a 2,048-8,192-token chunk of Qwen3-30B-A3B, top-8) take the large tiles."""
    gen = torch.Generator().manual_seed(7)
    counts = torch.randint(rows[0], rows[1], (128,), generator=gen).tolist()
    x, w, upper, lower, offsets = _problem(device, counts, 1536, 2048)
    if mode == "plain":
        y, ref = nested_moe.grouped_gemm_fp16(x, w, offsets), nested_moe.grouped_gemm_ref(x, w, offsets)
    else:
        y = nested_moe.nested_moe_gemm(x, upper, lower, offsets, Nesting.E4M3, mode)
        ref = nested_moe.nested_moe_ref(x, upper, lower, offsets, Nesting.E4M3, mode)
    assert _rel_err(y, ref) < 1e-2


@pytest.mark.parametrize("tile", [(64, 64, 64, 4, 3, None), (128, 64, 64, 4, 3, 168), (128, 128, 64, 8, 3, 128)])
def test_register_capped_tiles_match_reference(device, tile):
    """The probe's register-capped full-mode tiles (spilling to buy resident warps) still compute the layer."""
    from elastiserve.kernels import configs

    bm, bn, bk, warps, stages, cap = tile
    config = configs.GemmConfig(bm, bn, bk, num_warps=warps, num_stages=stages, ptx_decode=True, max_registers=cap)
    gen = torch.Generator().manual_seed(11)
    counts = torch.randint(60, 200, (128,), generator=gen).tolist()
    x, _, upper, lower, offsets = _problem(device, counts, 1536, 2048)
    y = nested_moe.nested_moe_gemm(x, upper, lower, offsets, Nesting.E4M3, "full", config=config)
    ref = nested_moe.nested_moe_ref(x, upper, lower, offsets, Nesting.E4M3, "full")
    assert _rel_err(y, ref) < 1e-2
