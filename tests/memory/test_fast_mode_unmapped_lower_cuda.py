"""CUDA only: fast-mode kernels launch while their lower plane is unmapped, as it is for a moment whenever the
restore worker remaps an evicted layer's residual (unmap, map, grant access) on its own thread. Triton's launcher
checks every pointer argument, read or not; the lower plane once reached it in fast mode and an eager step failed
with "Pointer argument (at 3) cannot be accessed" (combined, MoE, H200, session 9)."""

from __future__ import annotations

import pytest
import torch

from elastiserve.kernels import formats, nested_gemm, nested_moe  # noqa: F401  (registers the ops)
from elastiserve.kernels.formats import Nesting
from elastiserve.memory.virtual_tensor import VirtualRange

pytestmark = [pytest.mark.cuda]


def _fast_with_unmapped_lower(backend, op, upper):
    """``op(lower)`` with ``lower`` a uint8 view of ``upper``'s shape over a range whose only unit was mapped and is
    unmapped again; synchronized, so a fault surfaces here."""
    rng = VirtualRange(backend, upper.numel())
    handle = backend.create(rng.unit_bytes)
    try:
        rng.map_unit(0, handle)
        plane = rng.view(torch.uint8, tuple(upper.shape))
        rng.unmap_unit(0)
        out = op(plane)
        torch.cuda.synchronize()
        return out
    finally:
        rng.close()
        backend.release(handle)


@pytest.mark.parametrize("rows", [1, 16, 300])  # skinny, weight-only or fp8 tiles, large fp8 tiles
def test_fast_linear_never_passes_the_lower_plane(backend, rows):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(256, 512, generator=gen) * 0.05).half()
    upper, lower = (p.to(backend.device) for p in formats.split(w, Nesting.E5M2))
    x = torch.randn(rows, 512, generator=gen).half().to(backend.device)
    def linear(plane):
        return torch.ops.elastiserve.nested_linear(x, upper, plane, None, int(Nesting.E5M2), True)

    got = _fast_with_unmapped_lower(backend, linear, upper)
    want = linear(lower)
    assert torch.equal(got, want)  # the same kernel on the same upper plane


def test_fast_moe_never_passes_the_lower_plane(backend):
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(4, 128, 256, generator=gen) * 0.05).half()
    upper, lower = (p.to(backend.device) for p in formats.split(w, Nesting.E4M3))
    offsets = torch.tensor([0, 40, 40, 130, 200], dtype=torch.int32, device=backend.device)
    x = torch.randn(200, 256, generator=gen).half().to(backend.device)
    def moe(plane):
        return torch.ops.elastiserve.nested_moe(x, upper, plane, offsets, int(Nesting.E4M3), True)

    got = _fast_with_unmapped_lower(backend, moe, upper)
    want = moe(lower)
    assert torch.equal(got, want)
    assert got.isfinite().all()
