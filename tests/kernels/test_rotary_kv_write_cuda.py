"""CUDA-only pins of ``elastiserve::rotary_kv_write`` at Llama-3.1-8B sizes (32 q / 8 kv heads of dim 128, blocks of
16 tokens) for decode and prefill-chunk token counts: bit-equal to ``rotary_embedding`` then ``kv_write`` (PDL as the
platform launches it), and captured in a CUDA graph that replays correctly after its inputs change in place."""

from __future__ import annotations

import pytest
import torch
from elementwise_cases import paged_cache, qkv_split, rotary_tables, rotary_then_kv_write, scattered_slots

from elastiserve.kernels.rotary import rotary_kv_write, rotary_kv_write_ref

pytestmark = [pytest.mark.cuda]

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS, LAYER = 32, 8, 128, 16, 64, 2, 1


def llama8b_case(tokens: int, seed: int = 0):
    device = torch.device("cuda")
    q, k, v = qkv_split(device, tokens, Q_HEADS, KV_HEADS, HEAD_DIM)
    cos, sin = rotary_tables(device, 8192, HEAD_DIM)
    positions = torch.randint(0, 8192, (tokens,), generator=torch.Generator().manual_seed(seed)).to(device)
    cache = paged_cache(device, NUM_BLOCKS, NUM_LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM, seed=seed)
    slots = scattered_slots(device, tokens, NUM_BLOCKS * BLOCK_SIZE, skip_every=5, seed=seed)
    return positions, q, k, v, cos, sin, cache, slots


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


@pytest.mark.parametrize("tokens", [1, 2, 7, 33, 64])
def test_llama8b_sizes_equal_rotary_then_kv_write(tokens):
    positions, q, k, v, cos, sin, cache, slots = llama8b_case(tokens, seed=tokens)
    unfused_cache, ref_cache = cache.clone(), cache.clone()
    got_q = rotary_kv_write(positions, q, k, v, cos, sin, cache, LAYER, slots)
    unfused_q = rotary_then_kv_write(positions, q, k, v, cos, sin, unfused_cache, LAYER, slots)
    assert torch.equal(bits(got_q), bits(unfused_q))
    assert torch.equal(bits(cache), bits(unfused_cache))
    ref_q = rotary_kv_write_ref(positions, q, k, v, cos, sin, ref_cache, LAYER, slots)
    torch.testing.assert_close(got_q, ref_q, atol=1e-3, rtol=1e-3)  # the products contract to FMAs here
    torch.testing.assert_close(cache, ref_cache, atol=1e-3, rtol=1e-3)


def test_cuda_graph_replays_with_new_inputs():
    positions, q, k, v, cos, sin, cache, slots = llama8b_case(4)

    def step():
        return rotary_kv_write(positions, q, k, v, cos, sin, cache, LAYER, slots)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_q = step()
    fresh_positions, *_, fresh_slots = llama8b_case(4, seed=1)
    positions.copy_(fresh_positions)
    slots.copy_(fresh_slots)
    q.mul_(2.0)  # in place through the views of one qkv tensor
    k.mul_(-3.0)
    v.add_(1.0)
    expected_cache = cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    expected_q = rotary_then_kv_write(positions, q, k, v, cos, sin, expected_cache, LAYER, slots)
    assert torch.equal(bits(static_q), bits(expected_q))
    assert torch.equal(bits(cache), bits(expected_cache))
