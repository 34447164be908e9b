"""A padded step's MoE (a mixed CUDA graph's bucket): rows past ``valid_tokens`` route to no expert, so the real
rows equal an unpadded call and the padding rows come out zero, whatever their inputs hold; the CUDA twin replays
it in a graph (tests/engine/test_moe_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from elastiserve.engine.models import SparseMoeBlock

pytestmark = [pytest.mark.cpu]


@pytest.mark.parametrize("real", [1, 7, 10])
def test_padding_rows_route_to_no_expert(real):
    torch.manual_seed(5)
    block = SparseMoeBlock(32, 16, num_experts=8, top_k=2, renormalize=True).to(torch.float16)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.2)
    x = torch.randn(10, 32, dtype=torch.float16)
    x[real:] = float("nan")  # what an unwritten padding row can hold
    with torch.inference_mode():
        padded = block(x, torch.tensor([real], dtype=torch.int32))
        alone = block(x[:real].clone())
    torch.testing.assert_close(padded[:real], alone, atol=1e-3, rtol=1e-3)
    assert (padded[real:] == 0).all()
