"""``benchmarks/kernels/probe_exact_top.py`` without a GPU: ``main`` refuses to run on the CPU and writes nothing;
its whole-step variant with ``torch.topk`` gives the same logits as ``exact_top_logits`` (the chunked top-k)."""

from __future__ import annotations

import pytest
import torch
from kernel_scripts import load_kernel_script

from elastiserve.kernels import formats
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.nested_gemm import nested_linear_op
from elastiserve.kernels.nested_linear import exact_top_logits

pytestmark = [pytest.mark.cpu]


@pytest.fixture(scope="module")
def probe():
    return load_kernel_script("probe_exact_top")


def test_main_refuses_without_a_gpu(probe, tmp_path):
    out = tmp_path / "exact_top.json"
    assert probe.main(["--out", str(out)]) == 2
    assert not out.exists()


def test_the_torch_topk_variant_equals_the_shipped_step(probe):
    gen = torch.Generator().manual_seed(1)
    upper, lower = formats.split((torch.randn(1500, 64, generator=gen) * 0.05).half(), Nesting.E4M3)
    x = torch.randn(2, 64, generator=gen).half()
    approx = nested_linear_op(x, upper, lower, None, int(Nesting.E4M3), True, 0)
    got = probe._with_torch_topk(x, approx, upper, lower, 8)
    want = exact_top_logits(x, approx, upper, lower, None, Nesting.E4M3, 0, 8)
    assert not torch.equal(want, approx)  # some top logit changed
    torch.testing.assert_close(got.sort(-1).values, want.sort(-1).values, rtol=0, atol=0)


def test_a_top_k_setting_is_put_back_also_when_the_body_raises(probe):
    from elastiserve.kernels import top_k

    before = top_k.CHUNK, top_k.CHUNK_WARPS, top_k.LAST_STEP_WARPS
    with pytest.raises(RuntimeError), probe.top_k_setting(2048, 2, 8):
        assert (top_k.CHUNK, top_k.CHUNK_WARPS, top_k.LAST_STEP_WARPS) == (2048, 2, 8)
        raise RuntimeError("boom")
    assert before == (top_k.CHUNK, top_k.CHUNK_WARPS, top_k.LAST_STEP_WARPS)
    assert probe.TOP_K_SETTINGS[0] == before  # the probe's first setting is the shipped one
