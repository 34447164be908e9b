"""The packed-word PTX weight decode (``GemmConfig(ptx_decode=True)``): on an NVIDIA GPU full mode matches the fp16
GEMM and weight-only mode its reference, both nestings, across tile shapes; where it cannot run (CPU interpreter,
AMD) asking for it raises instead of silently taking the portable decode."""

import pytest
import torch

from elastiserve.kernels import formats, nested_gemm
from elastiserve.kernels.configs import GemmConfig
from elastiserve.kernels.formats import Nesting
from elastiserve.platforms import ConfigError

WEIGHT_STD = {Nesting.E4M3: 0.05, Nesting.E5M2: 4.0}
TILES = [GemmConfig(16, 64, 128, num_stages=6, ptx_decode=True),
         GemmConfig(16, 128, 256, num_warps=8, num_stages=3, split_k=4, ptx_decode=True),
         GemmConfig(64, 64, 128, num_stages=4, swap_ab=False, ptx_decode=True),
         GemmConfig(16, 32, 256, num_stages=4, split_k=2, ptx_decode=True),  # the sm90 decode rows (configs.py)
         GemmConfig(16, 128, 128, num_stages=4, ptx_decode=True)]


def _problem(m, n, k, nesting, device):
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(n, k, generator=gen) * WEIGHT_STD[nesting]).half()
    x = torch.randn(m, k, generator=gen).half()
    upper, lower = formats.split(w, nesting)
    return x.to(device), w.to(device), upper.to(device), lower.to(device)


@pytest.mark.cuda
@pytest.mark.parametrize("nesting", [Nesting.E4M3, Nesting.E5M2])
@pytest.mark.parametrize("mode", ["full", "weight_only"])
def test_ptx_decode_matches_the_portable_decode(device, nesting, mode):
    for m, n, k in [(1, 4096, 4096), (16, 6144, 4096), (37, 4096, 14336)]:
        x, w, upper, lower = _problem(m, n, k, nesting, device)
        ref = nested_gemm.nested_linear_ref(x, upper, lower, None, nesting, mode)
        if mode == "full":  # the reference itself is the exact fp16 GEMM here
            exact = (x.float() @ w.float().T).half()
            assert float((ref.float() - exact.float()).abs().max() / exact.float().abs().max()) < 1e-3
        portable = nested_gemm.nested_gemm(x, upper, lower, None, nesting, mode, config=GemmConfig(16, 64, 128))
        for config in TILES:
            y = nested_gemm.nested_gemm(x, upper, lower, None, nesting, mode, config=config)
            err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
            assert err < 1e-2, (m, n, k, config)
            # Same decoded weights, same accumulation order per tile: only the split-K reduction order may differ.
            assert float((y.float() - portable.float()).abs().max() / ref.float().abs().max()) < 1e-2


@pytest.mark.cpu
@pytest.mark.rocm
def test_ptx_decode_request_raises_where_it_cannot_run(device):
    x, _, upper, lower = _problem(5, 48, 64, Nesting.E4M3, device)
    with pytest.raises(ConfigError, match="ptx_decode"):
        nested_gemm.nested_gemm(x, upper, lower, None, Nesting.E4M3, "full", config=GemmConfig(16, 32, 32,
                                                                                             ptx_decode=True))
