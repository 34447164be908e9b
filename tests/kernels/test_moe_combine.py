"""Pins ``elastiserve::moe_combine`` (the MoE's weighted sum of each token's expert rows) against its pure-torch
reference and against the fp32 ``index_add_`` route it replaced: odd token counts and hidden sizes (a column block
split by the mask), top-1 to top-8, padding tokens whose rows hold NaN (never read), fp16 and bf16; plus typed shape
errors, opcheck and torch.compile(fullgraph=True). The Triton kernel runs interpreted on the CPU."""

from __future__ import annotations

import pytest
import torch

from elastiserve.kernels.moe_combine import moe_combine_ref
from elastiserve.kernels.rms_norm import ElementwiseShapeError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]
combine = torch.ops.elastiserve.moe_combine


def routed(device, tokens, hidden, top_k, dtype=torch.float16, padded=0, seed=0):
    """expert_out rows in a random 'sorted by expert' order, the inverse map, weights, and a padding mask."""
    gen = torch.Generator().manual_seed(seed)
    rows = tokens * top_k
    order = torch.randperm(rows, generator=gen)  # row i of expert_out is (token, j) = divmod(order[i], top_k)
    expert_out = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    padding = torch.zeros(tokens, dtype=torch.bool)
    if padded:
        padding[-padded:] = True
        pad_rows = torch.isin(order // top_k, torch.arange(tokens - padded, tokens))
        expert_out[pad_rows] = float("nan")  # what no expert wrote
    row_of = torch.empty_like(order).scatter_(0, order, torch.arange(rows)).view(tokens, top_k)
    to = lambda t: t.to(device)  # noqa: E731
    return to(expert_out), to(row_of), to(weights), to(padding), to(order)


@pytest.mark.parametrize("tokens, hidden, top_k", [(1, 40, 1), (5, 136, 2), (7, 1030, 8), (3, 2048, 4)])
def test_matches_reference_and_the_index_add_route(device, tokens, hidden, top_k):
    expert_out, row_of, weights, _, order = routed(device, tokens, hidden, top_k)
    out = combine(expert_out, row_of, weights)
    ref = moe_combine_ref(expert_out, row_of, weights)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float16
    if device.type == "cpu":  # same fp32 products, same sum order, one rounding
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    else:  # the GPU compiler fuses each multiply-add (one fp32 rounding where the reference has two): at 8 rows
        # a token that was off in the last fp32 bit on the H200 (session 17); within one fp16 ulp after the output's
        torch.testing.assert_close(out, ref, rtol=2**-10, atol=2**-14)
    # the route it replaced: fp32 weighted rows scattered into their tokens (sum order differs: within an ulp)
    flat_w = weights.reshape(-1)[order]
    legacy = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
    legacy.index_add_(0, order // top_k, expert_out.float() * flat_w.unsqueeze(-1))
    torch.testing.assert_close(out.float(), legacy, rtol=2e-3, atol=2e-3)
    assert not torch.equal(out, combine(expert_out, row_of, weights.flip(-1)) if top_k > 1 else out * 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_padding_tokens_are_zero_and_never_read(device, dtype):
    expert_out, row_of, weights, padding, _ = routed(device, 6, 72, 2, dtype=dtype, padded=2, seed=1)
    out = combine(expert_out, row_of, weights, padding)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert (out[-2:] == 0).all() and (out[:-2] != 0).any()
    ref = moe_combine_ref(expert_out, row_of, weights, padding)
    if dtype == torch.bfloat16 and device.type == "cpu":
        # Triton 3.6's interpreter truncates fp32 -> bf16 (1 + 2^-8 + 2^-12 -> 1.0); the GPU rounds to nearest
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=0)
    else:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_bad_shapes_are_typed_errors(device):
    expert_out, row_of, weights, padding, _ = routed(device, 4, 32, 2)
    with pytest.raises(ElementwiseShapeError, match="int64"):
        combine(expert_out, row_of.int(), weights)
    with pytest.raises(ElementwiseShapeError, match="weights"):
        combine(expert_out, row_of, weights[:, :1].contiguous())
    with pytest.raises(ElementwiseShapeError, match="token rows"):
        combine(expert_out[:5], row_of, weights)
    with pytest.raises(ElementwiseShapeError, match="padding_rows"):
        combine(expert_out, row_of, weights, padding[:3])


def test_opcheck_and_compile(device):
    expert_out, row_of, weights, padding, _ = routed(device, 5, 48, 2, padded=1)
    torch.library.opcheck(combine.default, (expert_out.nan_to_num(), row_of, weights))
    torch.library.opcheck(combine.default, (expert_out, row_of, weights, padding))
    backend = "aot_eager" if device.type == "cpu" else "inductor"
    compiled = torch.compile(lambda e, r, w, p: combine(e, r, w, p) * 2, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(expert_out, row_of, weights, padding),
                               combine(expert_out, row_of, weights, padding) * 2)
