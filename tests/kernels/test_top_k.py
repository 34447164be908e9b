"""``elastiserve::top_k_indices``: the positions of each row's k largest scores, in two chunked launches. Against
``torch.topk``: the same multiset of values (ties may pick other positions of an equal score), distinct positions,
for rows of one chunk, rows over several chunks with a short tail, a tail shorter than k, many ties, -inf and NaN
scores, fp16 / fp32, a strided row, a vocabulary that needs a third step; opcheck and typed errors."""

import pytest
import torch

from elastiserve.kernels import top_k
from elastiserve.kernels.top_k import top_k_indices, top_k_indices_op, top_k_indices_reference

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def _assert_top_k(scores: torch.Tensor, got: torch.Tensor, k: int) -> None:
    assert got.dtype == torch.int64 and got.shape == (scores.shape[0], k)
    assert int(got.min()) >= 0 and int(got.max()) < scores.shape[1]
    for row, picked in zip(scores, got):
        assert picked.unique().numel() == k, "positions repeat"
        clean = torch.nan_to_num(row.float(), nan=float("-inf"))  # the kernel ranks NaN as -inf
        want = clean.topk(k).values
        torch.testing.assert_close(clean[picked].sort(descending=True).values, want, rtol=0, atol=0)


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 300, 16), (3, 1024, 5), (2, 3000, 16), (1, 2050, 7),
                                              (2, 1030, 16), (1, 40, 40)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("last_step_max", [top_k.LAST_STEP_MAX, 512])
def test_top_k_indices_match_torch_topk(device, rows, n, k, dtype, last_step_max, monkeypatch):
    """One program a row, and (last step up to 512 scores) chunks of 1,024: n = 3,000 is two full chunks and a tail;
    1,030 a 6-score tail under k = 16; 40 with k = 40 all of a row."""
    monkeypatch.setattr(top_k, "LAST_STEP_MAX", last_step_max)
    scores = torch.randn(rows, n, generator=torch.Generator().manual_seed(n + k)).to(dtype).to(device)
    _assert_top_k(scores, top_k_indices(scores, k), k)


def test_ties_minus_inf_and_nan(device, monkeypatch):
    monkeypatch.setattr(top_k, "LAST_STEP_MAX", 512)  # three chunks of 1,024
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 4, (3, 2500), generator=gen).half()  # four values: thousands of ties
    scores[1] = float("-inf")
    scores[1, 2100] = 1.0  # one finite score in the tail chunk; the other 15 picks are -inf
    scores[2, ::3] = float("nan")
    scores = scores.to(device)
    _assert_top_k(scores, top_k_indices(scores, 16), 16)
    assert 2100 in top_k_indices(scores, 16)[1].tolist()


def test_a_strided_row_and_a_third_step(device, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 6000, generator=gen).half().to(device)
    _assert_top_k(wide[:, 100:5100], top_k_indices(wide[:, 100:5100], 8), 8)  # rows 6,000 apart
    monkeypatch.setattr(top_k, "LAST_STEP_MAX", 64)  # 5 chunks x 16 = 80 candidates: one more chunked step
    _assert_top_k(wide, top_k_indices(wide, 16), 16)


def test_a_large_k_goes_to_torch_topk(device):
    scores = torch.randn(2, 500, generator=torch.Generator().manual_seed(6)).to(device)
    got = top_k_indices(scores, top_k.MAX_K + 1)
    torch.testing.assert_close(scores.gather(-1, got).sort(-1).values,
                               scores.gather(-1, top_k_indices_reference(scores, top_k.MAX_K + 1)).sort(-1).values)


def test_opcheck(device):
    scores = torch.randn(3, 1500, generator=torch.Generator().manual_seed(7)).half().to(device)
    torch.library.opcheck(top_k_indices_op, (scores, 4))


def test_bad_inputs_are_refused(device):
    scores = torch.randn(2, 10).to(device)
    with pytest.raises(ValueError, match=r"k must be in 1..10"):
        top_k_indices(scores, 11)
    with pytest.raises(ValueError, match=r"k must be in 1..10"):
        top_k_indices(scores, 0)
    with pytest.raises(ValueError, match=r"scores must be \[R, N\]"):
        top_k_indices(scores[0], 2)
    with pytest.raises(ValueError, match="floating point"):
        top_k_indices(scores.long(), 2)
