"""The packed-word plane merge (``elastiserve::merge_planes``) is bit-exact against ``formats.merge`` over every
eligible fp16 pattern of both nestings, and the full-mode path built on it (merge once, vendor fp16 GEMM) matches
the fp16 GEMM, prescaled layers included."""

import pytest
import torch

from elastiserve.kernels import configs, formats, nested_gemm
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.merge_planes import merge_planes

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

ELIGIBLE_MAX = {Nesting.E4M3: formats.E4M3_MAX_ABS, Nesting.E5M2: formats.E5M2_MAX_ABS}


def _bits(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.int16).to(torch.int32) & 0xFFFF


@pytest.mark.parametrize("nesting", [Nesting.E4M3, Nesting.E5M2])
def test_merge_is_bit_exact_on_every_pattern(device, nesting):
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    eligible = every[torch.isfinite(every) & (every.float().abs() < ELIGIBLE_MAX[nesting])]
    eligible = eligible[: eligible.numel() // 8 * 8].reshape(-1, 8)  # rows of 8: two packed words per row
    upper, lower = formats.split(eligible, nesting)
    merged = merge_planes(upper.to(device), lower.to(device), nesting)
    assert merged.dtype == torch.float16 and merged.shape == eligible.shape
    assert torch.equal(_bits(merged.cpu()), _bits(eligible))


def test_merge_handles_a_ragged_tail_and_non_contiguous_planes(device):
    w = (torch.randn(7, 13, generator=torch.Generator().manual_seed(1)) * 0.05).half()  # 91 weights: no packing
    upper, lower = formats.split(w, Nesting.E4M3)
    assert torch.equal(_bits(merge_planes(upper.to(device), lower.to(device), Nesting.E4M3).cpu()), _bits(w))
    wide = (torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) * 0.05).half()
    up, lo = formats.split(wide, Nesting.E4M3)
    cols = merge_planes(up.to(device)[:, ::2], lo.to(device)[:, ::2], Nesting.E4M3)
    assert torch.equal(_bits(cols.cpu()), _bits(wide[:, ::2]))


@pytest.mark.parametrize("weight_exp", [0, 2])
def test_full_via_merged_weight_matches_fp16_gemm(device, weight_exp):
    gen = torch.Generator().manual_seed(3)
    m, n, k = (9, 48, 64) if device.type == "cpu" else (1024, 4096, 4096)
    w = (torch.randn(n, k, generator=gen) * 0.05 * 2**weight_exp).half()
    w[w.abs() < 2.0**-10] = 0.0  # values below 2^-12 would lose bits at the 2^-2 prescale (and force E5M2)
    w[0, 0] = 5.0 if weight_exp else 1.0  # max |w| = 5 needs the 2^-2 prescale to fit E4M3 nesting
    x, b = torch.randn(m, k, generator=gen).half(), torch.randn(n, generator=gen).half()
    nesting, exp, _ = formats.choose_nesting(w)
    assert (nesting, exp) == (Nesting.E4M3, weight_exp)
    upper, lower = formats.split(w, nesting, exp)
    x, w, b, upper, lower = (t.to(device) for t in (x, w, b, upper, lower))
    y = nested_gemm.full_via_merged_weight(x, upper, lower, b, nesting, exp)
    want = (x.float() @ w.float().T + b.float()).half()
    err = float((y.float() - want.float()).abs().max() / want.float().abs().max())
    assert err < 1e-2


def test_many_row_full_mode_takes_the_merged_path_on_gpus(monkeypatch):
    merged = lambda arch, m: configs.materializes_full(arch, m, 6144, 4096)  # noqa: E731 (a qkv-shaped weight)
    assert merged("sm90", 257) and not merged("sm90", 256)  # TMA rows below
    assert merged("sm80", 128) and not merged("sm80", 127)
    monkeypatch.setattr(configs, "FULL_SM90_TALL_ON", False)
    assert merged("sm90", 128) and not merged("sm90", 64)
    assert not merged("cpu", 4096)  # the interpreter keeps exercising the fused kernel


LLAMA_8B_CLASSES = {(28672, 4096): "wide", (4096, 14336): "long_k", (6144, 4096): "mid", (4096, 4096): "narrow"}


# Sessions 36-37's routing (H100): shared-B tiles on gate_up, down and o at 33-256 rows and on qkv at 33-64 and
# 129-256, the register-A tall tile on qkv at 65-128. A register-A tile's token tile covers its bucket's rows; qkv's and
# o's shared-B tiles at 129-256 rows take 128 tokens a tile (each weight tile read twice: 45.6 against 51.2 us).
SHARED_B = {"wide": (64, 128, 256), "long_k": (64, 128, 256), "narrow": (64, 128, 256), "mid": (64, 256)}


def test_sm90_full_mode_takes_tma_tiles_at_33_to_256_rows_per_weight_class(monkeypatch):
    assert configs.FULL_SM90_TALL_ON  # on since their GPU tests ran (session 33)
    for n, k in LLAMA_8B_CLASSES:
        assert configs.materializes_full("sm90", 257, n, k) and not configs.materializes_full("sm90", 256, n, k)
    for m in (33, 64, 65, 128, 129, 256):
        bucket = 64 if m <= 64 else 128 if m <= 128 else 256
        for (n, k), weight_class in LLAMA_8B_CLASSES.items():
            config = configs.choose_config("sm90", "full", m, n, k, 132)
            assert config.tma and config.ptx_decode, (m, n, k)
            assert config == configs.FULL_SM90_TMA[bucket][weight_class] == configs.full_tma_tile(m, n, k), (m, n, k)
            assert config.swap_ab == (bucket not in SHARED_B[weight_class]), (m, n, k)
            assert config.block_m >= (bucket if config.swap_ab else min(bucket, 128)), (m, n, k)
    for m in (32, 257):
        assert not configs.choose_config("sm90", "full", m, 6144, 4096, 132).tma
    monkeypatch.setattr(configs, "FULL_TMA_MIN_M_BY_CLASS", dict.fromkeys(configs.FULL_WEIGHT_CLASSES, 17))
    assert configs.choose_config("sm90", "full", 32, 6144, 4096, 132) == configs.FULL_SM90_ROWS_32  # its rows first
    assert configs.choose_config("sm90", "full", 100, 6144, 256, 132).split_k == 1  # 4 K blocks: no split
    assert not configs.choose_config("sm90", "full", 100, 6144, 4096, 132, grouped=True).tma
    assert not configs.choose_config("sm80", "full", 100, 6144, 4096, 108).tma


def test_full_mode_route_by_rows_and_tensor_layout(monkeypatch):
    upper, lower = (torch.zeros(64, 256, dtype=torch.uint8) for _ in range(2))
    aligned = torch.zeros(100, 256, dtype=torch.float16)
    monkeypatch.setattr(configs, "FULL_SM90_TALL_ON", False)
    assert nested_gemm.full_runs_merged("sm90", aligned, upper, lower)  # the TMA rows off: the merged weight
    monkeypatch.setattr(configs, "FULL_SM90_TALL_ON", True)
    strided = torch.zeros(100, 264, dtype=torch.float16)[:, 1:257]  # rows 16-byte aligned, the base is not
    assert not nested_gemm.full_runs_merged("sm90", aligned, upper, lower)  # the TMA tiles
    assert nested_gemm.full_runs_merged("sm90", strided, upper, lower)  # the materialized path, as before them
    assert nested_gemm.full_runs_merged("sm90", torch.zeros(300, 256, dtype=torch.float16), upper, lower)
    assert not nested_gemm.full_runs_merged("sm90", torch.zeros(64, 256, dtype=torch.float16), upper, lower)
    wide_upper, wide_lower = (torch.zeros(28672, 256, dtype=torch.uint8) for _ in range(2))  # gate_up: TMA from 33
    assert nested_gemm.full_runs_merged("sm90", strided[:48], wide_upper, wide_lower)
    assert not nested_gemm.full_runs_merged("sm90", aligned[:48], wide_upper, wide_lower)
    assert not nested_gemm.full_runs_merged("cpu", strided, upper, lower)  # the interpreter: the fused kernel
