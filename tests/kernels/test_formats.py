"""Pins the nested weight formats bit for bit, exhaustively over all 65,536 fp16 patterns.

E4M3: round trip exact on every eligible value, upper == satfinite RNE float8_e4m3fn(256 w), the three worked
examples of the notes (1.1). E5M2: round trip exact, upper is the correctly rounded (ties away) E5M2 value.
E4M3 with a power-of-two prescale 2^-s (s = 1, 2): round trip exact on every value whose scaled value is eligible
and exact, and exactness is precisely "w is a multiple of 2^(s-24)". Plus the fast-mode upcast, nesting choice
(prescale exponent and the E5M2 fallback when scaling would drop bits) and the bf16 -> fp16 exactness check.
"""

import pytest
import torch

from elastiserve.kernels import formats
from elastiserve.kernels.formats import Nesting

pytestmark = [pytest.mark.cpu]


@pytest.fixture(scope="module")
def all_fp16() -> torch.Tensor:
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.float16)


def _bits(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.int16).to(torch.int32) & 0xFFFF


def test_e4m3_round_trip_exhaustive(all_fp16):
    eligible = all_fp16[torch.isfinite(all_fp16) & (all_fp16.float().abs() <= formats.E4M3_MAX_ABS)]
    assert eligible.numel() == 32398  # the count the notes verified
    upper, lower = formats.split_e4m3(eligible)
    assert torch.equal(_bits(formats.merge_e4m3(upper, lower)), _bits(eligible))
    assert torch.equal(lower, (_bits(eligible) & 0xFF).to(torch.uint8))


def test_e4m3_upper_is_satfinite_rne_of_256w(all_fp16):
    eligible = all_fp16[torch.isfinite(all_fp16) & (all_fp16.float().abs() <= formats.E4M3_MAX_ABS)]
    upper, _ = formats.split_e4m3(eligible)
    expected = (eligible.float() * 256).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(upper, expected.view(torch.uint8))


@pytest.mark.parametrize(
    "bits, upper, lower",
    [(0xB4CD, 0xEA, 0xCD), (0x2BFF, 0x58, 0xFF), (0x3440, 0x68, 0x40)],  # notes 1.1: carry, exponent carry, tie
)
def test_e4m3_worked_examples(bits, upper, lower):
    w = torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16)
    u, low = formats.split_e4m3(w)
    assert (int(u), int(low)) == (upper, lower)
    assert int(_bits(formats.merge_e4m3(u, low))) == bits


def test_e4m3_fast_weight_is_upper_value_over_256(all_fp16):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[codes != 0x7F]
    codes = codes[codes != 0xFF]  # the two NaN codes
    as_fp16 = formats.upper_as_fp16(codes, Nesting.E4M3)
    exact = codes.view(torch.float8_e4m3fn).float() / 256
    assert torch.equal(as_fp16.float(), exact)


def test_e5m2_round_trip_exhaustive(all_fp16):
    eligible = all_fp16[torch.isfinite(all_fp16) & (all_fp16.float().abs() < formats.E5M2_MAX_ABS)]
    upper, lower = formats.split_e5m2(eligible)
    assert torch.equal(_bits(formats.merge_e5m2(upper, lower)), _bits(eligible))


def test_e5m2_upper_is_round_half_away(all_fp16):
    eligible = all_fp16[torch.isfinite(all_fp16) & (all_fp16.float().abs() < formats.E5M2_MAX_ABS)]
    upper, _ = formats.split_e5m2(eligible)
    w = eligible.double()
    hi = (_bits(eligible) >> 8).to(torch.uint8)
    toward_zero = hi.view(torch.float8_e5m2).double()
    away = (hi.to(torch.int32) + 1).to(torch.uint8).view(torch.float8_e5m2).double()  # next magnitude up
    expected = torch.where((w - toward_zero).abs() >= (away - w).abs(), away, toward_zero)
    got = upper.view(torch.float8_e5m2).double()
    assert torch.equal(got, expected)
    # and it is the value the fast path multiplies by, with scale 1
    assert torch.equal(formats.upper_as_fp16(upper, Nesting.E5M2).double(), got)
    # differs from torch's RNE cast only on exact ties
    rne = eligible.to(torch.float8_e5m2).double()
    tie = (w - toward_zero).abs() == (away - w).abs()
    assert torch.equal(got[~tie], rne[~tie]) and bool(tie.any())


def test_e5m2_saturation_guard():
    w = torch.tensor([65504.0, -65504.0, 61440.0], dtype=torch.float16)
    upper, _ = formats.split_e5m2(w)
    assert torch.isfinite(upper.view(torch.float8_e5m2).float()).all()


@pytest.mark.parametrize("exp", [1, 2])
def test_e4m3_prescale_round_trip_exhaustive(all_fp16, exp):
    finite = all_fp16[torch.isfinite(all_fp16)]
    scaled = formats.scale_pow2(finite, -exp)
    back = formats.scale_pow2(scaled, exp)
    exact = _bits(back) == _bits(finite)
    # Scaling by 2^-s is exact iff w is a multiple of 2^(s-24) (only subnormal results can drop bits).
    rule = torch.remainder(finite.double(), 2.0 ** (exp - 24)) == 0
    assert torch.equal(exact, rule)
    eligible = exact & (scaled.float().abs() <= formats.E4M3_MAX_ABS)
    w = finite[eligible]
    # s gains 1024 * s patterns per sign at the top and loses as many small ones that are not multiples of 2^(s-24).
    assert w.numel() == 32398
    upper, lower = formats.split(w, Nesting.E4M3, exp)
    assert torch.equal(_bits(formats.merge(upper, lower, Nesting.E4M3, exp)), _bits(w))  # signed zeros too
    assert torch.equal(lower, (_bits(scaled[eligible]) & 0xFF).to(torch.uint8))
    expected = (w.float() * 2.0 ** (8 - exp)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(upper, expected.view(torch.uint8))  # a valid FP8 weight with scale 2^(s-8)
    value, scale = formats.upper_as_fp8(upper, Nesting.E4M3, exp)
    assert scale == 2.0 ** (exp - 8)
    assert torch.equal(formats.upper_as_fp16(upper, Nesting.E4M3, exp).float(), value.float() * scale)


@pytest.mark.parametrize(
    "values, nesting, exp",
    [([0.5, -1.8], Nesting.E4M3, 0), ([1.9, -3.0], Nesting.E4M3, 1), ([5.0, -0.0, 0.3], Nesting.E4M3, 2),
     ([-29.0], Nesting.E4M3, 4), ([30.0], Nesting.E5M2, 0), ([5.0, 2.0**-24], Nesting.E5M2, 0),
     ([61440.0], Nesting.NONE, 0), ([float("inf")], Nesting.NONE, 0)],
)
def test_choose_nesting(values, nesting, exp):
    w = torch.tensor(values, dtype=torch.float16)
    got, got_exp, reason = formats.choose_nesting(w)
    assert (got, got_exp) == (nesting, exp) and reason
    if nesting is Nesting.E4M3:
        upper, lower = formats.split(w, nesting, exp)
        assert torch.equal(_bits(formats.merge(upper, lower, nesting, exp)), _bits(w))


def test_prescale_falls_back_when_scaling_drops_bits():
    """max|w| = 5 needs s = 2, but 3 * 2^-24 / 4 is not an fp16: the layer must not nest as E4M3."""
    w = torch.tensor([5.0, 3 * 2.0**-24, -1.0], dtype=torch.float16)
    choice = formats.choose_nesting(w)
    assert choice.nesting is Nesting.E5M2 and choice.weight_exp == 0 and "no exact E4M3 prescale" in choice.reason
    with pytest.raises(ValueError):
        formats.split(w, Nesting.E4M3, 5)


def test_choose_nesting_rejects_non_fp16():
    assert formats.choose_nesting(torch.zeros(3, dtype=torch.bfloat16))[0] == Nesting.NONE


def test_bf16_to_fp16_checked():
    ok = torch.tensor([0.0, -0.30078125, 2.0**-17, 65280.0, 3 * 2.0**-24], dtype=torch.bfloat16)
    cast = formats.bf16_to_fp16_checked(ok)
    assert cast is not None and torch.equal(cast.float(), ok.float())
    for bad in (255 * 2.0**-25, 70000.0, float("nan")):
        assert formats.bf16_to_fp16_checked(torch.tensor([1.0, bad], dtype=torch.bfloat16)) is None


def test_bf16_to_fp16_exhaustive_rule():
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = bits.float()
    finite = torch.isfinite(x)
    mag = x.abs()
    tiny_multiple = (mag < 2.0**-17) & (torch.remainder(x.double(), 2.0**-24) == 0)
    rule = (mag == 0) | ((mag >= 2.0**-17) & (mag <= 65504)) | tiny_multiple
    exact_elementwise = x[finite] == x[finite].to(torch.float16).float()
    assert torch.equal(exact_elementwise, rule[finite])
