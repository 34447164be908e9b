"""``elastiserve::exact_rows``: each row of x against the exact weight rows it picked, merged from both planes in one
launch. Against its torch reference (fp32 sums in another order: one fp16 rounding step apart at most) for both
nestings, a prescaled E4M3 layer, a bias, picked counts that are not a power of two and K not a multiple of the K
tile; against the fp16 layer itself; opcheck; typed errors."""

import pytest
import torch

from elastiserve.kernels import formats
from elastiserve.kernels.exact_rows import exact_rows, exact_rows_op, exact_rows_reference
from elastiserve.kernels.formats import Nesting

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def _layer(n: int, k: int, scale: float, seed: int, prescale: bool = False):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * scale).half()
    if prescale:  # max |w| = 5 needs E4M3's 2^-2 prescale; values under 2^-10 would lose bits to it (forcing E5M2)
        w[w.abs() < 2.0**-10] = 0.0
        w[0, 0] = 5.0
    nesting, exp, _ = formats.choose_nesting(w)
    upper, lower = formats.split(w, nesting, exp)
    return w, nesting, exp, upper, lower


def _picked(rows: int, n: int, top: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=gen)[:top] for _ in range(rows)])


@pytest.mark.parametrize(("scale", "want_nesting", "want_exp"),
                         [(0.05, Nesting.E4M3, 0), (0.2, Nesting.E4M3, 2), (40.0, Nesting.E5M2, 0)])
@pytest.mark.parametrize(("rows", "top", "k"), [(1, 16, 300), (3, 5, 64), (2, 21, 257)])
def test_exact_rows_match_the_reference_and_the_fp16_layer(device, scale, want_nesting, want_exp, rows, top, k):
    n = 40
    w, nesting, exp, upper, lower = _layer(n, k, scale, seed=rows * 7 + top, prescale=bool(want_exp))
    assert (nesting, exp) == (want_nesting, want_exp)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, k, generator=gen).half()
    bias = torch.randn(n, generator=gen).half()
    picked = _picked(rows, n, top, seed=k)
    x, bias, picked, upper, lower, w = (t.to(device) for t in (x, bias, picked, upper, lower, w))
    for b in (None, bias):
        got = exact_rows(x, picked, upper, lower, b, nesting, exp)
        want = exact_rows_reference(x, picked, upper, lower, b, nesting, exp)
        assert got.dtype == torch.float16 and got.shape == (rows, top)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        layer = x.float() @ w.float().T + (0 if b is None else b.float())  # the fp16 layer, fp32 sums
        torch.testing.assert_close(got.float(), layer.gather(-1, picked), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(("block_t", "block_k"), [(1, 256), (2, 256), (4, 256), (1, 64), (4, 512)])
def test_other_launch_shapes_agree_with_the_default(device, block_t, block_k):
    """``block_t`` only spreads the picked rows over more programs (probe_exact_top.py times the shapes): each row's
    sum runs the same K loop, so the bytes match the default's; another K tile sums in another order, one fp16
    rounding apart at most."""
    _, nesting, exp, upper, lower = _layer(40, 300, 0.05, seed=12)
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(13)).half()
    picked = _picked(3, 40, 11, seed=14)
    x, picked, upper, lower = (t.to(device) for t in (x, picked, upper, lower))
    want = exact_rows(x, picked, upper, lower, None, nesting, exp)
    got = exact_rows(x, picked, upper, lower, None, nesting, exp, block_t=block_t, block_k=block_k)
    if block_k == 256:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2**-10, atol=2**-24)


def test_int32_indices_and_an_fp32_row(device):
    _, nesting, exp, upper, lower = _layer(24, 48, 0.05, seed=3)
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(4))
    picked = _picked(2, 24, 6, seed=5).to(torch.int32)
    x, picked, upper, lower = (t.to(device) for t in (x, picked, upper, lower))
    got = exact_rows(x, picked, upper, lower, None, nesting, exp)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, exact_rows_reference(x, picked.long(), upper, lower, None, nesting, exp),
                               rtol=1e-5, atol=1e-5)


def test_opcheck(device):
    _, nesting, exp, upper, lower = _layer(24, 40, 0.05, seed=6)
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(7)).half()
    bias = torch.randn(24, generator=torch.Generator().manual_seed(8)).half()
    picked = _picked(3, 24, 4, seed=9)
    args = (*(t.to(device) for t in (x, picked, upper, lower, bias)), int(nesting), exp)
    torch.library.opcheck(exact_rows_op, args)


def test_bad_inputs_are_refused(device):
    _, nesting, _, upper, lower = _layer(8, 16, 0.05, seed=10)
    x, picked = torch.randn(2, 16).half(), torch.zeros(2, 3, dtype=torch.long)
    x, picked, upper, lower = (t.to(device) for t in (x, picked, upper, lower))
    with pytest.raises(ValueError, match=r"picked \[R, T\]"):
        exact_rows(x, picked[:1], upper, lower, None, nesting)
    with pytest.raises(ValueError, match=r"planes must be \[N, 16\]"):
        exact_rows(x, picked, upper[:, :8], lower[:, :8], None, nesting)
    with pytest.raises(ValueError, match="int32 or int64"):
        exact_rows(x, picked.float(), upper, lower, None, nesting)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        exact_rows(x, picked, upper, lower, torch.zeros(3, device=device).half(), nesting)
    with pytest.raises(ValueError, match="nesting must be E4M3 or E5M2"):
        exact_rows(x, picked, upper, lower, None, Nesting.NONE)
    with pytest.raises(ValueError, match="block_t must be a power of two, got 3"):
        exact_rows(x, picked, upper, lower, None, nesting, block_t=3)
    with pytest.raises(ValueError, match="block_k must be a power of two, got 0"):
        exact_rows(x, picked, upper, lower, None, nesting, block_k=0)
