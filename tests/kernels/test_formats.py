"""Pins the nested weight formats bit for bit, exhaustively over all 65,536 fp16 patterns.

E4M3: round trip exact on every eligible value, upper == satfinite RNE float8_e4m3fn(256 w), the three worked
examples of the notes (1.1). E5M2: round trip exact, upper is the correctly rounded (ties away) E5M2 value.
Plus the fast-mode upcast, nesting choice and the bf16 -> fp16 exactness check.
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


@pytest.mark.parametrize(
    "values, nesting",
    [([0.5, -1.8], Nesting.E4M3), ([1.9, -3.0], Nesting.E5M2), ([61440.0], Nesting.NONE),
     ([float("inf")], Nesting.NONE)],
)
def test_choose_nesting(values, nesting):
    got, reason = formats.choose_nesting(torch.tensor(values, dtype=torch.float16))
    assert got == nesting and reason


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
