"""A padded step's MoE (a mixed CUDA graph's bucket): rows past the real tokens (``padding_rows_of``) route to no
expert, so the real rows equal an unpadded call and the padding rows come out zero, whatever their inputs hold; the
CUDA twin replays it in a graph (tests/engine/test_moe_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_moe_block

from elastiserve.engine.models.moe import padding_rows_of

pytestmark = [pytest.mark.cpu]


@pytest.mark.parametrize("real", [1, 7, 10])
def test_padding_rows_route_to_no_expert(real):
    block = random_moe_block(32, 16, seed=5)
    x = torch.randn(10, 32, dtype=torch.float16)
    x[real:] = float("nan")  # what an unwritten padding row can hold
    with torch.inference_mode():
        padded = block(x, padding_rows_of(torch.tensor([real], dtype=torch.int32), 10))
        alone = block(x[:real].clone())
    torch.testing.assert_close(padded[:real], alone, atol=1e-3, rtol=1e-3)
    assert (padded[real:] == 0).all()


def test_an_unpadded_step_has_no_padding_mask():
    assert padding_rows_of(None, 10) is None
    assert padding_rows_of(torch.tensor([3]), 5).tolist() == [False, False, False, True, True]
