"""CUDA only: the static-fp16 MoE block is CUDA-graph capturable (its experts run the grouped Triton kernel)."""

import pytest
import torch
from tiny_models import random_moe_block

from elastiserve.engine.models.moe import padding_rows_of

pytestmark = [pytest.mark.cuda]


def test_fp16_moe_block_replays_in_a_cuda_graph(device):
    """Unnested fp16 experts run the grouped Triton kernel, which a CUDA graph can capture (the per-expert loop read
    the offsets back and failed capture at the static-fp16 MoE engine's start on the H200); replay equals eager."""
    block = random_moe_block(64, 32, seed=3, device=device)
    x = torch.randn(5, 64, device=device, dtype=torch.float16)
    with torch.inference_mode():
        eager = block(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, block(x), atol=2e-3, rtol=2e-3)
    assert eager.isfinite().all()


def test_padding_rows_of_a_captured_block_route_to_no_expert(device):
    """A mixed graph's padding rows (past ``valid_tokens``, which a replay may change) go to no expert: the real rows
    equal an unpadded eager call, the padding rows come out zero even when their inputs hold NaN."""
    block = random_moe_block(64, 32, seed=4, device=device)
    x = torch.randn(12, 64, device=device, dtype=torch.float16)
    valid = torch.tensor([9], dtype=torch.int32, device=device)
    with torch.inference_mode():
        block(x, padding_rows_of(valid, 12))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(x, padding_rows_of(valid, 12))
        for real in (9, 5):
            x.copy_(torch.randn_like(x))
            x[real:] = float("nan")
            valid.fill_(real)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(captured[:real], block(x[:real].clone()), atol=2e-3, rtol=2e-3)
            assert (captured[real:] == 0).all()
