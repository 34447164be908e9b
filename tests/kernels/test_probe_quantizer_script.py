"""``benchmarks/kernels/probe_quantizer.py`` without a GPU: ``main`` refuses to run on the CPU, and the routing tables
it swaps in for one route are put back afterwards, also when the measurement raises."""

from __future__ import annotations

import pytest
from kernel_scripts import load_kernel_script

from elastiserve.kernels import fp8_activations, silu_mul
from elastiserve.platforms import current_platform

pytestmark = [pytest.mark.cpu]


@pytest.fixture(scope="module")
def probe():
    return load_kernel_script("probe_quantizer")


def test_main_refuses_without_a_gpu(probe, tmp_path):
    out = tmp_path / "quant.json"
    assert probe.main(["--out", str(out)]) == 2
    assert not out.exists()


def test_a_route_sets_both_tables_and_puts_them_back(probe):
    arch = current_platform().arch
    before = dict(fp8_activations.QUANT_SPLIT_ROWS), dict(silu_mul.SPLIT_QUANT_MAX_ROWS)
    with probe.route("split"):
        assert fp8_activations.splits_quantized_rows(4096, 14336)
        assert silu_mul.splits_quantizing_rows(128, 14336)
    with pytest.raises(RuntimeError), probe.route("split"):
        raise RuntimeError("boom")
    with probe.route("unsplit"):
        assert not fp8_activations.splits_quantized_rows(64, 14336)
        assert not silu_mul.splits_quantizing_rows(2, 14336)
    with pytest.raises(ValueError, match="unknown route"), probe.route("fastest"):
        pass
    assert (dict(fp8_activations.QUANT_SPLIT_ROWS), dict(silu_mul.SPLIT_QUANT_MAX_ROWS)) == before
    assert not fp8_activations.splits_quantized_rows(4096, 14336) or arch in before[0]
