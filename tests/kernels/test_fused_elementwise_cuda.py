"""CUDA-only pins of the fused elementwise ops at Llama-3.1-8B sizes (hidden 4096, 32 q / 8 kv heads of dim 128,
intermediate 14336) for batch-1 decode and a prefill chunk, and one decoder layer's worth of them captured in a CUDA
graph that replays correctly after its inputs change in place (no host syncs, fixed grids)."""

from __future__ import annotations

import pytest
import torch
from elementwise_cases import assert_rms_norm_close, qkv_views, rotary_tables

from elastiserve.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm
from elastiserve.kernels.rotary import rotary_embedding, rotary_embedding_ref
from elastiserve.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

pytestmark = [pytest.mark.cuda]

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, EPS = 4096, 32, 8, 128, 14336, 1e-5


def layer_inputs(tokens: int):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device=device, generator=gen).half()
    residual = (torch.randn(tokens, HIDDEN, device=device, generator=gen) * 4).half()
    weight = (torch.rand(HIDDEN, device=device, generator=gen) + 0.5).half()
    gate_up = (torch.randn(tokens, 2 * INTERMEDIATE, device=device, generator=gen) * 3).half()
    positions = torch.randint(0, 8192, (tokens,), device=device, generator=gen)
    return x, residual, weight, gate_up, positions


@pytest.mark.parametrize("tokens", [1, 257])
def test_llama8b_sizes_match_reference(tokens):
    x, residual, weight, gate_up, positions = layer_inputs(tokens)
    assert_rms_norm_close(rms_norm(x, weight, EPS), x, weight, EPS)
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    _, expected_residual = fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(new_residual, expected_residual)
    assert_rms_norm_close(out, expected_residual, weight, EPS)

    q, k = qkv_views(x.device, tokens, Q_HEADS, KV_HEADS, HEAD_DIM)
    cos, sin = rotary_tables(x.device, 8192, HEAD_DIM)
    got_q, got_k = rotary_embedding(positions, q, k, cos, sin)
    expected_q, expected_k = rotary_embedding_ref(positions, q, k, cos, sin)
    torch.testing.assert_close(got_q, expected_q, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got_k, expected_k, atol=1e-3, rtol=1e-3)

    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), atol=1e-3, rtol=1e-3)


def test_cuda_graph_replays_with_new_inputs():
    x, residual, weight, gate_up, positions = layer_inputs(1)
    q, k = qkv_views(x.device, 1, Q_HEADS, KV_HEADS, HEAD_DIM)  # views of one qkv row, as in the model
    cos, sin = rotary_tables(x.device, 8192, HEAD_DIM)

    def layer():
        normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
        q_rot, k_rot = rotary_embedding(positions, q, k, cos, sin)
        return rms_norm(normed, weight, EPS), new_residual, q_rot, k_rot, silu_and_mul(gate_up)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer()
    fresh_x, fresh_residual, _, fresh_gate_up, fresh_positions = layer_inputs(2)
    x.copy_(fresh_x[:1])
    residual.copy_(fresh_residual[:1])
    gate_up.copy_(fresh_gate_up[:1])
    positions.copy_(fresh_positions[:1])
    q.mul_(2.0)  # in place through the views
    k.mul_(-3.0)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(static_out, layer(), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
