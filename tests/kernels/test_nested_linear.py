"""Pins NestedLinear and nest_model: conversion of fp16 / bf16 / fp32 linears, the 16-bit fallback with its reason,
full mode equal to the original layer, fast mode close to it, mode switching, binding an external lower plane,
a layer with max|w| = 5 nesting as E4M3 with prescale 2^-2 (full mode equal to the layer, reported as prescaled),
a tiny nested model under ``torch.compile(fullgraph=True)`` in both modes, and a head that keeps its largest
fast-mode logits exact (``exact_top``).
"""

import pytest
import torch
from torch import nn

from elastiserve.kernels import nested_linear
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.nested_linear import NestedLinear, nest_model, set_mode
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def _linear(k, n, dtype, device, scale=0.05, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.mul_(scale / layer.weight.std())
    return layer.to(device=device, dtype=dtype)


def _rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


class TinyModel(nn.Module):
    def __init__(self, device, dtype=torch.float16):
        super().__init__()
        self.up = _linear(40, 48, dtype, device, seed=1)
        self.big = _linear(48, 48, dtype, device, scale=80.0, seed=2)  # max|w| > 16 * 1.8192: E5M2
        self.down = _linear(48, 32, dtype, device, bias=False, seed=3)
        self.lm_head = _linear(32, 16, dtype, device, seed=4)

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.big(torch.relu(self.up(x))))))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_full_mode_equals_original_layer(device, dtype):
    layer = _linear(40, 48, dtype, device)
    nested, reason = NestedLinear.from_linear(layer)
    assert nested.nesting is Nesting.E4M3, reason
    x = torch.randn(2, 3, 40, device=device, dtype=dtype)
    with torch.no_grad():
        want = nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    got = nested(x)
    assert got.shape == (2, 3, 48) and got.dtype == dtype
    assert _rel_err(got, want) < 1e-2
    nested.set_mode("fast")
    fast = nested(x)
    assert _rel_err(fast, want) < 0.1 and not torch.equal(fast, got)


def test_prescaled_layer_full_mode_equals_original(device):
    layer = _linear(40, 48, torch.float16, device, scale=1.0, seed=6)
    with torch.no_grad():
        layer.weight[layer.weight.abs() < 2.0**-10] = 0.0  # random fp16 below 2^-12 would lose bits at s = 2
        layer.weight[3, 4] = 5.0
    nested, reason = NestedLinear.from_linear(layer)
    assert (nested.nesting, nested.weight_exp) == (Nesting.E4M3, 2) and "2^-2" in reason
    x = torch.randn(2, 3, 40, device=device, dtype=torch.float16)
    with torch.no_grad():
        want = nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert _rel_err(nested(x), want) < 1e-2
    nested.set_mode("fast")
    assert _rel_err(nested(x), want) < 0.1
    model = nn.Sequential(layer, nn.ReLU(), _linear(48, 16, torch.float16, device, seed=7))
    report = nest_model(model, skip=())
    assert report.prescaled == {"0": 2} and "prescale: 1" in report.summary()
    assert report.count(Nesting.E4M3) == 2
    with pytest.raises(ConfigError):
        NestedLinear(40, 48, Nesting.E5M2, weight_exp=1)


def test_unnestable_layers_stay_16_bit(device):
    huge = _linear(40, 48, torch.float16, device)
    with torch.no_grad():
        huge.weight[0, 0] = 65000.0
    nested, reason = NestedLinear.from_linear(huge)
    assert nested.nesting is Nesting.NONE and "61440" in reason and nested.weight.dtype == torch.float16
    inexact = _linear(40, 48, torch.bfloat16, device)
    with torch.no_grad():
        inexact.weight[0, 0] = 255 * 2.0**-25  # 8 significant bits below 2^-17: not an fp16
    nested, reason = NestedLinear.from_linear(inexact)
    assert nested.nesting is Nesting.NONE and "bf16" in reason and nested.weight.dtype == torch.bfloat16
    x = torch.randn(5, 40, device=device, dtype=torch.bfloat16)
    for mode in ("full", "fast"):
        nested.set_mode(mode)
        assert torch.equal(nested(x), inexact(x))


def test_nest_model_reports_every_linear(device):
    model = TinyModel(device)
    x = torch.randn(7, 40, device=device, dtype=torch.float16)
    want = model(x)
    report = nest_model(model)
    assert {name: kind for name, (kind, _) in report.layers.items()} == {
        "up": Nesting.E4M3, "big": Nesting.E5M2, "down": Nesting.E4M3, "lm_head": Nesting.NONE}
    assert "skipped" in report.unnested["lm_head"] and isinstance(model.lm_head, nn.Linear)
    assert isinstance(model.big, NestedLinear) and report.count(Nesting.E4M3) == 2
    assert _rel_err(model(x), want) < 1e-2
    assert set_mode(model, "fast") == 3 and set_mode(model, "fast") == 0
    assert _rel_err(model(x), want) < 0.2
    with pytest.raises(ConfigError):
        set_mode(model, "fp8")


def test_bind_lower_uses_external_view(device):
    layer = _linear(40, 48, torch.float16, device)
    nested, _ = NestedLinear.from_linear(layer)
    x = torch.randn(5, 40, device=device, dtype=torch.float16)
    before = nested(x)
    arena = torch.zeros(48, 64, dtype=torch.uint8, device=device)  # row stride 64 != K: a strided view
    view = arena[:, 8:48]
    view.copy_(nested.lower)
    nested.bind_lower(view)
    assert nested.lower.data_ptr() == view.data_ptr() and "lower" in dict(nested.named_buffers())
    assert torch.equal(nested(x), before)
    arena.zero_()  # the layer reads the external bytes, so wiping them must change full mode
    assert not torch.equal(nested(x), before)
    with pytest.raises(ConfigError):
        nested.bind_lower(torch.zeros(48, 41, dtype=torch.uint8, device=device))


@pytest.mark.parametrize("exact_top", [0, 3])  # 3: the head keeps 3 fast-mode logits a row exact
def test_compile_fullgraph_both_modes(device, exact_top):
    torch._dynamo.reset()
    model = TinyModel(device)
    nest_model(model, skip=())
    if exact_top:
        model.lm_head.set_exact_top(exact_top)
    x = torch.randn(9, 40, device=device, dtype=torch.float16)
    compiled = torch.compile(model, fullgraph=True)
    for mode in ("full", "fast", "full"):
        set_mode(model, mode)
        assert torch.allclose(compiled(x).float(), model(x).float(), rtol=1e-3, atol=1e-3), mode


def test_mode_name_is_validated():
    with pytest.raises(ConfigError):
        nested_linear._check_mode("half")


@pytest.mark.parametrize("scale", [0.05, 20.0])  # E4M3 (a prescale from 1.8192 up) and E5M2 heads
def test_exact_top_logits_are_the_full_heads_and_the_rest_the_fast_heads(device, scale):
    """A head that keeps its 5 largest fast-mode logits a row exact: those entries equal full mode's (the exact fp16
    weight; fp32 sums in another order), every other entry is fast mode's bit for bit, and the argmax is full mode's
    wherever full mode's top logit is among fast mode's top 5."""
    head = _linear(64, 300, torch.float16, device, scale=scale, seed=8)
    nested, _ = NestedLinear.from_linear(head)
    x = torch.randn(7, 64, device=device, dtype=torch.float16)
    full = nested(x)
    nested.set_mode("fast")
    fast = nested(x)
    nested.set_exact_top(5)
    assert not nested.takes_fp8_rows(7) and not nested.takes_fp8_rows(4096)  # the exact rows need 16-bit x
    got = nested(x)
    picked = fast.float().topk(5, dim=-1).indices
    kept = torch.ones_like(fast, dtype=torch.bool).scatter(-1, picked, False)
    assert torch.equal(got[kept], fast[kept])
    scale_out = full.float().abs().max()
    assert float((got.gather(-1, picked).float() - full.gather(-1, picked).float()).abs().max()) <= 2e-3 * scale_out
    moved = float((fast.gather(-1, picked).float() - full.gather(-1, picked).float()).abs().max())
    assert moved > 1e-2 * scale_out  # the fast head's values there were not already the full head's
    in_top = (full.argmax(-1, keepdim=True) == picked).any(-1)
    assert bool(in_top.all()) and torch.equal(got.argmax(-1), full.argmax(-1))
    nested.set_mode("full")
    assert torch.equal(nested(x), full)  # full mode ignores exact_top
    with pytest.raises(ConfigError, match=r"exact_top must be in 0\.\.300"):
        nested.set_exact_top(301)


def test_exact_top_logits_reference_with_bias_and_the_plain_layers_refusal(device):
    from elastiserve.kernels import formats

    head = _linear(48, 40, torch.float16, device, seed=9)
    nested, _ = NestedLinear.from_linear(head)
    x = torch.randn(3, 48, device=device, dtype=torch.float16)
    approx = torch.randn(3, 40, device=device, dtype=torch.float16)
    got = nested_linear.exact_top_logits(x, approx, nested.upper, nested.lower, nested.bias, nested.nesting,
                                         nested.weight_exp, 40)  # every entry recomputed: the exact layer
    weight = formats.merge(nested.upper, nested.lower, nested.nesting, nested.weight_exp)
    want = (x.float() @ weight.float().T + nested.bias.float()).half()
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    plain = NestedLinear(8, 4, Nesting.NONE)
    with pytest.raises(ConfigError, match="exact_top needs a nested layer"):
        plain.set_exact_top(2)
