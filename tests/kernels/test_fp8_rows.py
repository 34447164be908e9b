"""Fast mode's fp8 rows quantized where they are made: the quantizing norms (``rms_norm_quant``,
``fused_add_rms_norm_quant``) and ``silu_and_mul_quant`` write the very bytes and scales that ``quantize_per_token``
writes from the unfused op's fp16 output (the fallback for prefill-sized SiLU rows too), the new residual bit-exact;
the fp8 GEMM on those rows (``nested_gemm(..., x_scale=)``, op ``elastiserve::nested_linear_fp8``) equals the GEMM that
quantizes for itself; ``NestedLinear`` takes ``Fp8Rows`` only where it runs fp8. Typed errors, opcheck, and
torch.compile(fullgraph=True) over norm -> fp8 GEMM -> SiLU-and-mul -> fp8 GEMM."""

from __future__ import annotations

import pytest
import torch

from elastiserve.kernels import fp8_activations, nested_gemm
from elastiserve.kernels.formats import Nesting, split
from elastiserve.kernels.fp8_activations import Fp8Rows, quantize_per_token
from elastiserve.kernels.nested_linear import NestedLinear
from elastiserve.kernels.rms_norm import (
    ElementwiseShapeError,
    fused_add_rms_norm,
    fused_add_rms_norm_quant,
    fused_add_rms_norm_quant_ref,
    rms_norm,
    rms_norm_quant,
    rms_norm_quant_ref,
)
from elastiserve.kernels.silu_mul import silu_and_mul, silu_and_mul_quant, silu_and_mul_quant_ref
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

EPS = 1e-5


def rows(device, tokens, width, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, width, generator=gen) * scale).half().to(device)


def assert_same_fp8_rows(got, want):
    q, scale = got
    q_want, scale_want = want
    assert q.shape == q_want.shape and q.dtype == q_want.dtype and scale.dtype == torch.float32
    assert torch.equal(scale, scale_want)
    assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))


def assert_close_to_reference(got, want):
    """Against the pure-torch composition: the fused norm's fp16 row is within one fp16 ulp of the reference's (see
    test_fused_elementwise), so a few codes may move by one fp8 step; the scales agree to that ulp."""
    (q, scale), (q_ref, scale_ref) = got, want
    torch.testing.assert_close(scale, scale_ref, rtol=2e-3, atol=0)
    assert (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item() >= 0.98
    dequant = q.float() * scale[:, None]
    torch.testing.assert_close(dequant, q_ref.float() * scale_ref[:, None], rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("tokens, hidden", [(1, 72), (5, 136), (3, 4096)])
def test_rms_norm_quant_writes_the_quantizers_bytes(device, tokens, hidden):
    x, weight = rows(device, tokens, hidden, hidden), rows(device, 1, hidden, 7, 0.5)[0] + 1
    x[0, hidden - 1] = 200.0  # the row's maximum in its last element
    got = rms_norm_quant(x, weight, EPS, False)
    assert_same_fp8_rows(got, quantize_per_token(rms_norm(x, weight, EPS)))
    assert_close_to_reference(got, rms_norm_quant_ref(x, weight, EPS))


@pytest.mark.parametrize("tokens, hidden", [(1, 72), (6, 136)])
def test_fused_add_rms_norm_quant_writes_the_quantizers_bytes_and_the_residual(device, tokens, hidden):
    x, residual = rows(device, tokens, hidden, 1), rows(device, tokens, hidden, 2)
    weight = rows(device, 1, hidden, 3, 0.5)[0] + 1
    x_before, residual_before = x.clone(), residual.clone()
    q, scale, new_residual = fused_add_rms_norm_quant(x, residual, weight, EPS, False)
    out, want_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(new_residual, want_residual) and torch.equal(new_residual, x + residual)
    assert_same_fp8_rows((q, scale), quantize_per_token(out))
    ref_q, ref_scale, ref_residual = fused_add_rms_norm_quant_ref(x, residual, weight, EPS)
    assert torch.equal(new_residual, ref_residual)
    assert_close_to_reference((q, scale), (ref_q, ref_scale))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not be written"


# One program a row (decode sizes), then rows the quantizer loops over (more than QUANT_FEW_ROWS of long rows), where
# the op runs SiLU-and-mul and the quantizer.
# Rows longer than QUANT_SHORT_K at few rows take the split route (silu_mul.SPLIT_QUANT_MAX_ROWS; the CPU's table sends
# (3, 5000) and (1, 4100) there, whose last chunk is ragged and holds the row's maximum; (2, 14336) is Llama-8B's).
@pytest.mark.parametrize("tokens, inter", [(1, 40), (7, 136), (3, 5000), (1, 4100), (2, 14336),
                                           (fp8_activations.QUANT_FEW_ROWS + 1, fp8_activations.QUANT_SHORT_K + 8)])
def test_silu_and_mul_quant_writes_the_quantizers_bytes(device, tokens, inter):
    gate_up = rows(device, tokens, 2 * inter, inter, 4.0)
    gate_up[0, 2 * inter - 1] = 60.0  # up's last value: the first row's maximum sits in its last column
    if tokens > 1:
        gate_up[tokens - 1] = 0  # an all-zero row keeps a positive scale
    got = silu_and_mul_quant(gate_up, False)
    assert_same_fp8_rows(got, quantize_per_token(silu_and_mul(gate_up)))
    if tokens <= 7:  # the reference's exp may differ in the last bit: the rows stay within one fp8 step
        assert_close_to_reference(got, silu_and_mul_quant_ref(gate_up))


def test_silu_and_mul_quant_on_strided_3d_rows(device):
    wide = rows(device, 6, 3 * 40, 5, 4.0)
    gate_up = wide[:, : 2 * 40].reshape(2, 3, 80)  # rows 120 apart, two leading dims
    q, scale = silu_and_mul_quant(gate_up, False)
    assert q.shape == (6, 40) and scale.shape == (6,)
    assert_same_fp8_rows((q, scale), quantize_per_token(silu_and_mul(gate_up).reshape(6, 40)))


def nested_problem(device, m, n, k, nesting=Nesting.E4M3):
    gen = torch.Generator().manual_seed(m * n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).half()
    upper, lower = split(w, nesting)
    bias = torch.randn(n, generator=gen).half()
    x = torch.randn(m, k, generator=gen).half()
    return x.to(device), upper.to(device), lower.to(device), bias.to(device)


@pytest.mark.parametrize("m", [1, 5, 33])
def test_fp8_gemm_on_quantized_rows_equals_the_gemm_that_quantizes(device, m):
    x, upper, lower, bias = nested_problem(device, m, 48, 64)
    want = nested_gemm.nested_gemm(x, upper, lower, bias, Nesting.E4M3, "fp8")
    q, scale = quantize_per_token(x)
    got = nested_gemm.nested_gemm(q, upper, lower, bias, Nesting.E4M3, "fp8", x_scale=scale)
    assert torch.equal(got, want)
    ref = nested_gemm.nested_linear_fp8_ref(q, scale, upper, lower, bias, Nesting.E4M3)
    assert torch.equal(ref, nested_gemm.nested_linear_ref(x, upper, lower, bias, Nesting.E4M3, "fp8"))
    err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < 2e-3


def test_nested_linear_fp8_op_and_errors(device):
    x, upper, lower, bias = nested_problem(device, 3, 32, 32)
    q, scale = quantize_per_token(x)
    got = torch.ops.elastiserve.nested_linear_fp8(q, scale, upper, lower, bias, int(Nesting.E4M3))
    ref = nested_gemm.nested_linear_fp8_ref(q, scale, upper, lower, bias, Nesting.E4M3)
    assert (got.float() - ref.float()).abs().max() / ref.float().abs().max() < 2e-3
    with pytest.raises(ConfigError):  # fp8 rows into a full-mode GEMM
        nested_gemm.nested_gemm(q, upper, lower, bias, Nesting.E4M3, "full", x_scale=scale)
    with pytest.raises(ValueError):  # scales of another row count
        nested_gemm.nested_gemm(q, upper, lower, bias, Nesting.E4M3, "fp8", x_scale=scale[:2])
    with pytest.raises(ValueError):  # fp16 rows with scales
        nested_gemm.nested_gemm(x, upper, lower, bias, Nesting.E4M3, "fp8", x_scale=scale)
    with pytest.raises(ElementwiseShapeError):
        rms_norm_quant(x.float(), torch.ones(32, device=device), EPS, False)
    with pytest.raises(ElementwiseShapeError):
        silu_and_mul_quant(x[:, :31], False)


def test_opcheck_each_op(device):
    x, upper, lower, bias = nested_problem(device, 3, 32, 40)
    residual, weight = rows(device, 3, 40, 9), rows(device, 1, 40, 4, 0.5)[0] + 1
    q, scale = quantize_per_token(x)
    ops = torch.ops.elastiserve
    torch.library.opcheck(ops.rms_norm_quant.default, (x, weight, EPS, False))
    torch.library.opcheck(ops.fused_add_rms_norm_quant.default, (x, residual, weight, EPS, False))
    torch.library.opcheck(ops.silu_and_mul_quant.default, (x, False))
    # The schema check compares inputs before and after with arithmetic that torch has no fp8 kernel for
    # ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn): the other checks run, and the inputs' bytes are
    # compared here instead.
    before = q.view(torch.uint8).clone(), scale.clone()
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for b in (bias, None):
        torch.library.opcheck(ops.nested_linear_fp8.default, (q, scale, upper, lower, b, int(Nesting.E4M3)),
                              test_utils=checks)
    assert torch.equal(q.view(torch.uint8), before[0]) and torch.equal(scale, before[1])


def test_nested_linear_takes_fp8_rows_only_where_it_runs_fp8(device, monkeypatch):
    x, upper, lower, _ = nested_problem(device, 4, 32, 32)
    linear = torch.nn.Linear(32, 32).half().to(device)
    with torch.no_grad():
        linear.weight.copy_(nested_gemm.reference_weight(upper, lower, Nesting.E4M3, "full").half())
    layer, _ = NestedLinear.from_linear(linear)
    rows_in = Fp8Rows(*quantize_per_token(x))
    assert not layer.takes_fp8_rows(4)  # full mode
    with pytest.raises(ConfigError):
        layer(rows_in)
    layer.set_mode("fast")
    # The CPU has no fp8 MMA: fast mode there is weight-only unless the platform says otherwise.
    monkeypatch.setattr("elastiserve.kernels.nested_linear.fast_mode_for", lambda rows, **_: "fp8")
    monkeypatch.setattr("elastiserve.kernels.nested_gemm.fast_mode_for", lambda rows, **_: "fp8")
    assert layer.takes_fp8_rows(4)
    assert torch.equal(layer(rows_in), layer(x))


def test_compiled_norm_gemm_silu_gemm(device):
    x, upper, lower, _ = nested_problem(device, 3, 64, 32)
    _, down_upper, down_lower, _ = nested_problem(device, 3, 32, 32)
    weight = rows(device, 1, 32, 2, 0.5)[0] + 1
    ops = torch.ops.elastiserve

    def block(x):
        q, scale = ops.rms_norm_quant(x, weight, EPS, False)
        gate_up = ops.nested_linear_fp8(q, scale, upper, lower, None, int(Nesting.E4M3))
        q, scale = ops.silu_and_mul_quant(gate_up, False)
        return ops.nested_linear_fp8(q, scale, down_upper, down_lower, None, int(Nesting.E4M3))

    expected = block(x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    assert torch.equal(compiled(x), expected)


def test_fast_mode_threshold_for_quantized_input(monkeypatch):
    """Rows that arrive quantized have their own fp8 threshold (no quantizer launch to pay for): with it at 1 and the
    plain one at 2, one row runs fp8 only where a norm or SiLU-and-mul quantized it; the MoE kernel from 1 row. Rows
    longer than QUANT_SHORT_K (down_proj's) have theirs, 2 on sm90: one such row stays weight-only, and the
    ``NestedLinear`` asks with its own K."""
    from dataclasses import replace

    from elastiserve.platforms import FastGemm, current_platform

    sm90 = replace(current_platform(), arch="sm90", facts=replace(current_platform().facts, fast_gemm=FastGemm.FP8_MMA))
    monkeypatch.setattr(nested_gemm, "current_platform", lambda: sm90)
    monkeypatch.setitem(nested_gemm.FP8_MIN_M, "sm90", 2)
    monkeypatch.setitem(nested_gemm.FP8_MIN_M_QUANTIZED_INPUT, "sm90", 1)
    assert nested_gemm.fast_mode_for(1) == "weight_only"
    assert nested_gemm.fast_mode_for(1, quantized_input=True) == "fp8"
    assert nested_gemm.fast_mode_for(1, grouped=True) == "fp8"
    assert nested_gemm.fast_mode_for(2) == nested_gemm.fast_mode_for(2, quantized_input=True) == "fp8"
    monkeypatch.setitem(nested_gemm.FP8_MIN_M_QUANTIZED_LONG_INPUT, "sm90", 2)
    long_k = fp8_activations.QUANT_SHORT_K + 16
    assert nested_gemm.fast_mode_for(1, quantized_input=True, k=fp8_activations.QUANT_SHORT_K) == "fp8"
    assert nested_gemm.fast_mode_for(1, quantized_input=True, k=long_k) == "weight_only"
    assert nested_gemm.fast_mode_for(2, quantized_input=True, k=long_k) == "fp8"
    linear = torch.nn.Linear(long_k, 8, bias=False).half()
    torch.nn.init.normal_(linear.weight, std=0.05)
    down, _ = NestedLinear.from_linear(linear)
    down.set_mode("fast")
    assert not down.takes_fp8_rows(1) and down.takes_fp8_rows(2)
