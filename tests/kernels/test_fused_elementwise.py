"""Pins the fused elementwise ops of a decoder layer against their pure-torch references (the unfused model code):
RMSNorm alone and with the residual add (at most 1 fp16 ulp off, almost always exact; the new residual bit-exact),
neox rotary of q and k in one launch (non-contiguous views out of a qkv split, odd head counts, head dims whose half
is not a power of two) and SiLU-and-mul. Triton kernels run interpreted on the CPU. Also: typed shape errors,
opcheck, and torch.compile(fullgraph=True) over all four ops."""

from __future__ import annotations

import pytest
import torch
from elementwise_cases import assert_rms_norm_close, qkv_views, rotary_tables

from elastiserve.kernels.rms_norm import (
    ElementwiseShapeError,
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from elastiserve.kernels.rotary import rotary_embedding, rotary_embedding_ref
from elastiserve.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

EPS = 1e-5


def norm_inputs(device, tokens, hidden, dtype=torch.float16):
    gen = torch.Generator().manual_seed(tokens * 1000 + hidden)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype).to(device)
    residual = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype).to(device)
    weight = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dtype).to(device)
    return x, residual, weight


@pytest.mark.parametrize("tokens, hidden", [(1, 72), (3, 136), (7, 72), (7, 136)])
def test_rms_norm_within_one_ulp_of_reference(device, tokens, hidden):
    x, _, weight = norm_inputs(device, tokens, hidden)
    assert_rms_norm_close(rms_norm(x, weight, EPS), x, weight, EPS)


def test_rms_norm_per_head_on_qkv_views(device):
    # Qwen3's q/k norm: [T, H, D] views whose rows are not one stride apart.
    q, k = qkv_views(device, tokens=7, q_heads=6, kv_heads=3, head_dim=24)
    weight = torch.linspace(0.5, 1.5, 24, device=device).half()
    for x in (q, k):
        assert not x.is_contiguous()
        got = rms_norm(x, weight, 1e-6)
        assert got.is_contiguous() and got.shape == x.shape
        assert_rms_norm_close(got, x, weight, 1e-6)


def test_rms_norm_fp32_and_wide_rows(device):
    x, _, weight = norm_inputs(device, 3, 136, dtype=torch.float32)
    torch.testing.assert_close(rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS), atol=1e-6, rtol=1e-5)
    x, _, weight = norm_inputs(device, 2, 8192)  # Llama-70B's hidden size: one program, 8192-wide block
    assert_rms_norm_close(rms_norm(x, weight, EPS), x, weight, EPS)


@pytest.mark.parametrize("tokens, hidden", [(1, 72), (3, 136), (7, 136)])
def test_fused_add_rms_norm_matches_reference(device, tokens, hidden):
    x, residual, weight = norm_inputs(device, tokens, hidden)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(new_residual, x + residual), "the residual add is one fp16 rounding, like torch's"
    assert torch.equal(new_residual, expected_residual)
    assert_rms_norm_close(out, expected_residual, weight, EPS)  # the norm of the new residual...
    assert (out == expected_out).float().mean().item() >= 0.99  # ...which is the fused reference's output
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not be written"


def test_fused_add_rms_norm_strided_inputs(device):
    x, residual, weight = norm_inputs(device, 5, 2 * 72)
    x, residual, weight = x[:, :72], residual[:, 72:], weight[:72].contiguous()  # rows 144 apart
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(new_residual, fused_add_rms_norm_ref(x, residual, weight, EPS)[1])
    assert_rms_norm_close(out, new_residual, weight, EPS)


@pytest.mark.parametrize("tokens", [1, 3, 7])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(6, 2, 16), (5, 1, 24), (3, 3, 8)])
def test_rotary_matches_reference_on_qkv_views(device, tokens, q_heads, kv_heads, head_dim):
    q, k = qkv_views(device, tokens, q_heads, kv_heads, head_dim)
    cos, sin = rotary_tables(device, 300, head_dim)
    positions = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(tokens)).to(device)
    q_before, k_before = q.clone(), k.clone()
    got_q, got_k = rotary_embedding(positions, q, k, cos, sin)
    expected_q, expected_k = rotary_embedding_ref(positions, q, k, cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    torch.testing.assert_close(got_q, expected_q, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got_k, expected_k, atol=1e-3, rtol=1e-3)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    # int32 positions give the same rotation
    got_q32, _ = rotary_embedding(positions.int(), q, k, cos, sin)
    assert torch.equal(got_q32, got_q)


def test_rotary_position_zero_is_identity(device):
    q, k = qkv_views(device, 4, 6, 2, 16)
    cos, sin = rotary_tables(device, 8, 16)
    got_q, got_k = rotary_embedding(torch.zeros(4, dtype=torch.int64, device=device), q, k, cos, sin)
    assert torch.equal(got_q, q) and torch.equal(got_k, k)


@pytest.mark.parametrize("shape", [(1, 2 * 72), (3, 2 * 136), (7, 2 * 136), (2, 3, 2 * 40)])
def test_silu_and_mul_matches_reference(device, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    gate_up = (torch.randn(shape, generator=gen) * 4).half().to(device)
    got = silu_and_mul(gate_up)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.is_contiguous()
    torch.testing.assert_close(got, silu_and_mul_ref(gate_up), atol=1e-3, rtol=1e-3)


def test_silu_and_mul_strided_and_empty(device):
    wide = (torch.randn(5, 3 * 136) * 4).half().to(device)
    gate_up = wide[:, : 2 * 136]  # rows 408 apart
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), atol=1e-3, rtol=1e-3)
    assert silu_and_mul(wide[:0, :16]).shape == (0, 8)  # a MoE step where no row reached the experts


def test_shape_errors_are_typed(device):
    x, residual, weight = norm_inputs(device, 3, 72)
    with pytest.raises(ElementwiseShapeError):
        rms_norm(x, weight[:70], EPS)
    with pytest.raises(ElementwiseShapeError):
        fused_add_rms_norm(x, residual.float(), weight, EPS)
    with pytest.raises(ElementwiseShapeError):
        silu_and_mul(x[:, :71])
    q, k = qkv_views(device, 3, 6, 2, 16)
    cos, sin = rotary_tables(device, 8, 16)
    positions = torch.arange(3, device=device)
    with pytest.raises(ElementwiseShapeError):
        rotary_embedding(positions, q, k[..., :8], cos, sin)
    with pytest.raises(ElementwiseShapeError):
        rotary_embedding(positions, q, k, cos[:, :4], sin[:, :4])
    with pytest.raises(ElementwiseShapeError):
        rotary_embedding(positions.float(), q, k, cos, sin)


def test_opcheck_each_op(device):
    x, residual, weight = norm_inputs(device, 3, 72)
    q, k = qkv_views(device, 3, 6, 2, 16)
    cos, sin = rotary_tables(device, 16, 16)
    positions = torch.tensor([0, 5, 15], device=device)
    ops = torch.ops.elastiserve
    torch.library.opcheck(ops.rms_norm.default, (x, weight, EPS))
    torch.library.opcheck(ops.rms_norm.default, (q, weight[:16].contiguous(), EPS))
    torch.library.opcheck(ops.fused_add_rms_norm.default, (x, residual, weight, EPS))
    torch.library.opcheck(ops.rotary_embedding.default, (positions, q, k, cos, sin))
    torch.library.opcheck(ops.silu_and_mul.default, (x,))


def test_ops_compile_fullgraph(device):
    x, residual, weight = norm_inputs(device, 3, 64)
    q, k = qkv_views(device, 3, 4, 2, 16)
    cos, sin = rotary_tables(device, 16, 16)
    positions = torch.tensor([1, 2, 9], device=device)

    def layer_step(x, residual, q, k, positions):
        normed, residual = fused_add_rms_norm(x, residual, weight, EPS)
        q, k = rotary_embedding(positions, rms_norm(q, weight[:16], EPS), k, cos, sin)
        return silu_and_mul(normed * 1.0), residual, q, k

    args = (x, residual, q, k, positions)
    expected = layer_step(*args)
    compiled = torch.compile(layer_step, fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    for got, want in zip(compiled(*args), expected, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
