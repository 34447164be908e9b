"""``benchmarks/kernels/probe_exact_top.py`` without a GPU: ``main`` refuses to run on the CPU and writes nothing."""

from __future__ import annotations

import pytest
from kernel_scripts import load_kernel_script

pytestmark = [pytest.mark.cpu]


def test_main_refuses_without_a_gpu(tmp_path):
    probe = load_kernel_script("probe_exact_top")
    out = tmp_path / "exact_top.json"
    assert probe.main(["--out", str(out)]) == 2
    assert not out.exists()
