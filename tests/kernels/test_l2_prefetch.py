"""The weight prefetch into L2 (``kernels/l2_prefetch.py``): what ``prefetch_plan`` asks each program for, and, on
the GPU, that the decode GEMMs compute the same bits with and without it. Where it sits in the compiled kernel
(before ``griddepcontrol.wait``, no memory touched before the wait): tests/kernels/test_launch.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from elastiserve.kernels import configs, formats, l2_prefetch, nested_gemm, skinny_gemm
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.l2_prefetch import prefetch_plan
from elastiserve.platforms import Vendor, current_platform

DEFAULT_SM90 = dict(l2_prefetch.L2_PREFETCH_SHARE.get("sm90", {}))  # before any fixture patches it

OFF = {"PREFETCH_ROW_BYTES": 0, "PREFETCH_CHUNKS": 1, "PREFETCH_THREADS": 32}
MODES = ("full", "weight_only", "fp8", "plain")


@pytest.fixture
def sm90(monkeypatch):
    """An H200-like platform that launches programmatically, with the interpreter out of the way."""
    platform = replace(current_platform(), vendor=Vendor.NVIDIA, arch="sm90", programmatic_launch=True,
                       l2_bytes=60 << 20)
    monkeypatch.setattr(l2_prefetch, "current_platform", lambda: platform)
    monkeypatch.setattr(l2_prefetch, "triton_interpret", lambda: False)
    monkeypatch.setitem(l2_prefetch.L2_PREFETCH_SHARE, "sm90", dict.fromkeys(MODES, 0.5))
    return platform


@pytest.mark.cpu
def test_off_on_the_interpreter():
    plane = torch.zeros(64, 4096, dtype=torch.uint8)
    assert prefetch_plan(plane, "weight_only", 16, 4, 4096, 1, 4) == OFF


@pytest.mark.cpu
def test_plan_fits_the_budget_and_the_rows(sm90):
    # o_proj's upper plane, 256 programs of 16 rows over all of K: 30 MiB / 4096 rows = 7680 B a row -> 4096 (a power
    # of two), in 4 pieces of MIN_PIECE (4 warps = 128 threads could take 8 a row)
    upper = torch.zeros(4096, 4096, dtype=torch.uint8)
    plan = prefetch_plan(upper, "weight_only", 16, 256, 4096, 1, 4)
    assert plan == {"PREFETCH_ROW_BYTES": 4096, "PREFETCH_CHUNKS": 4, "PREFETCH_THREADS": 128}
    assert prefetch_plan(upper, "weight_only", 64, 64, 4096, 1, 4)["PREFETCH_CHUNKS"] == 2  # at most a piece a thread
    # full mode's two planes halve each one's share: 3840 B -> 2048, two pieces a row
    both = prefetch_plan(upper, "full", 16, 256, 4096, 1, 4, lower=upper)
    assert both["PREFETCH_ROW_BYTES"] == 2048 and both["PREFETCH_CHUNKS"] == 2
    # a plain fp16 weight of 64 columns: its rows' 128 bytes cap the 1097 of the budget (30 MiB / 28672 rows)
    gate_up = torch.zeros(28672, 64, dtype=torch.float16)
    assert prefetch_plan(gate_up, "plain", 16, 1792, 64, 1, 4)["PREFETCH_ROW_BYTES"] == 128
    # split K: the last split holds 4096 - 3 * 1152 = 640 columns, so no row asks past its own end
    small = torch.zeros(64, 4096, dtype=torch.uint8)
    assert prefetch_plan(small, "weight_only", 16, 16, 1152, 4, 4)["PREFETCH_ROW_BYTES"] == 512
    # a budget too small for one 16-byte piece a thread, and the share set to 0: off
    assert prefetch_plan(upper, "weight_only", 16, 1 << 20, 4096, 1, 4) == OFF
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(l2_prefetch.L2_PREFETCH_SHARE, "sm90", dict.fromkeys(MODES, 0.5) | {"weight_only": 0.0})
        assert prefetch_plan(upper, "weight_only", 16, 256, 4096, 1, 4) == OFF
        assert prefetch_plan(upper, "fp8", 16, 256, 4096, 1, 4) == plan  # the share is per mode
        patch.setitem(l2_prefetch.L2_PREFETCH_SHARE, "sm90", {"fp8": 0.5})  # a mode the arch does not name: off
        assert prefetch_plan(upper, "full", 16, 256, 4096, 1, 4, lower=upper) == OFF


@pytest.mark.cpu
def test_the_default_prefetches_only_one_plane_modes(sm90, monkeypatch):
    """Session 23's timing: an eighth of the L2 sped fast mode up and slowed full mode and the plain fp16 step."""
    monkeypatch.setitem(l2_prefetch.L2_PREFETCH_SHARE, "sm90", dict(DEFAULT_SM90))
    upper = torch.zeros(4096, 4096, dtype=torch.uint8)
    # 7.5 MiB over 4096 rows = 1920 B -> 1024 a row, one MIN_PIECE
    for mode in ("weight_only", "fp8"):
        assert prefetch_plan(upper, mode, 16, 256, 4096, 1, 4) == {
            "PREFETCH_ROW_BYTES": 1024, "PREFETCH_CHUNKS": 1, "PREFETCH_THREADS": 128}
    assert prefetch_plan(upper, "full", 16, 256, 4096, 1, 4, lower=upper) == OFF
    assert prefetch_plan(torch.zeros(4096, 4096, dtype=torch.float16), "plain", 16, 256, 4096, 1, 4) == OFF


@pytest.mark.cpu
def test_plan_refuses_unaligned_rows(sm90):
    wide = torch.zeros(64, 4100, dtype=torch.uint8)
    assert prefetch_plan(wide, "weight_only", 16, 4, 4100, 1, 4) == OFF  # a row stride off 16 bytes
    odd = torch.zeros(64 * 4096 + 1, dtype=torch.uint8)[1:].view(64, 4096)  # base off 16 bytes
    assert prefetch_plan(odd, "weight_only", 16, 4, 4096, 1, 4) == OFF
    aligned = torch.zeros(64, 4096, dtype=torch.uint8)
    assert prefetch_plan(aligned, "full", 16, 4, 4096, 1, 4, lower=odd) == OFF  # either plane of full mode
    assert prefetch_plan(aligned, "weight_only", 16, 4, 4096, 1, 4, lower=odd)["PREFETCH_ROW_BYTES"] == 4096  # unread
    assert prefetch_plan(aligned, "weight_only", 16, 8, 1000, 2, 4) == OFF  # a split starting off 16 bytes
    assert prefetch_plan(aligned.t(), "weight_only", 16, 4, 64, 1, 4) == OFF  # not row-major
    assert prefetch_plan(aligned, "weight_only", 16, 4, 4096, 1, 4)["PREFETCH_ROW_BYTES"] == 4096


def _planes(n, k, nesting, device, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * (0.05 if nesting == Nesting.E4M3 else 4.0)).half()
    x = torch.randn(2, k, generator=gen).half()
    upper, lower = formats.split(w, nesting)
    return x.to(device), w.to(device), upper.to(device), lower.to(device)


@pytest.mark.cuda
def test_decode_gemms_compute_the_same_bits_with_and_without(device, monkeypatch):
    """Llama-3.1-8B's o_proj and down_proj shapes at one and two rows, every decode path: the plain and nested skinny
    kernels and the fp8 tl.dot kernel (which takes its split-K merge on sm90), with the platform's share and with 0."""
    platform = current_platform()
    cases = [(4096, 4096, Nesting.E4M3), (4096, 14336, Nesting.E5M2)]

    def run_all():
        out = []
        for i, (n, k, nesting) in enumerate(cases):
            x, w, upper, lower = _planes(n, k, nesting, device, seed=i)
            for m in (1, 2):
                out.append(skinny_gemm.skinny_linear(x[:m], w))
                for mode in ("full", "weight_only"):
                    out.append(skinny_gemm.skinny_nested(x[:m], upper, lower, None, nesting, mode))
                if platform.facts.fast_gemm.name.startswith("FP8"):
                    out.append(nested_gemm.nested_gemm(x[:m], upper, lower, None, nesting, "fp8"))
                full_tile = configs.choose_config(platform.arch, "full", 16, n, k, platform.num_sms)
                out.append(nested_gemm.nested_gemm(x[:m], upper, lower, None, nesting, "full", config=full_tile))
        torch.cuda.synchronize()
        return out

    upper = torch.zeros(4096, 4096, dtype=torch.uint8, device=device)
    # every mode prefetches, not only the default's (a share a deployment may set must not change a bit)
    monkeypatch.setitem(l2_prefetch.L2_PREFETCH_SHARE, platform.arch, dict.fromkeys(MODES, 0.125))
    if platform.programmatic_launch:
        assert prefetch_plan(upper, "full", 16, 256, 4096, 1, 4, lower=upper)["PREFETCH_ROW_BYTES"] > 0
    with_prefetch = run_all()
    monkeypatch.setitem(l2_prefetch.L2_PREFETCH_SHARE, platform.arch, {})
    assert prefetch_plan(upper, "full", 16, 256, 4096, 1, 4, lower=upper) == OFF
    without = run_all()
    assert len(with_prefetch) == len(without) >= 16
    for a, b in zip(with_prefetch, without):
        assert torch.equal(a, b)
