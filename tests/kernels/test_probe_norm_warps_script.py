"""``benchmarks/kernels/probe_norm_warps.py`` without a GPU: ``main`` refuses to run on the CPU, and the warp rule it
swaps in for a measurement is put back afterwards, also when the measurement raises."""

from __future__ import annotations

import pytest
from kernel_scripts import load_kernel_script

pytestmark = [pytest.mark.cpu]


@pytest.fixture(scope="module")
def probe():
    return load_kernel_script("probe_norm_warps")


def test_main_refuses_without_a_gpu(probe, tmp_path):
    out = tmp_path / "norm.json"
    assert probe.main(["--out", str(out)]) == 2
    assert not out.exists()


def test_the_warp_rule_is_restored(probe):
    rms_norm = probe.rms_norm  # the module (the package's attribute of that name is the op)
    default = rms_norm._num_warps
    assert probe._with_warps(4, lambda: rms_norm._num_warps(4096)) == 4
    with pytest.raises(RuntimeError):
        probe._with_warps(8, lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert rms_norm._num_warps is default and default(4096) == 4 and default(4096, quant=True) == 16
