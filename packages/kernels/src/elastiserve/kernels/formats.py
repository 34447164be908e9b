"""Nested FP16 weight formats: split an fp16 weight into an 8-bit upper plane and a raw low-byte plane.

Two nestings (see the notes on formats and kernels, sections 1.1 and 1.2):

* ``E4M3`` (NestedFP-compatible): upper = RNE-satfinite E4M3FN of ``256 * w``; needs ``max|w| <= 1.8192`` so the
  fp16 exponent's top bit is zero. The low byte duplicates mantissa bit 7, which undoes the rounding carry.
  A layer with a larger range nests ``w * 2^-s`` instead (per-layer power-of-two prescale, ``s = weight_exp`` in
  1..4) when that scaling is exact on every element; the GEMM multiplies its fp32 accumulator by ``2^s``.
* ``E5M2`` (DPS extension): upper = fp16 high byte rounded half away from zero; decode ``hi = u - (l >> 7)``;
  needs ``max|w| < 61440`` so the rounding never has to saturate.

Everything here is pure torch integer arithmetic on the 16-bit patterns: the same code is the reference for the
kernels and the converter used at load time.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import torch

E4M3_MAX_ABS = 1.8192  # NestedFP's per-layer threshold; fp16 values in [1.875, 2) would encode to NaN
E5M2_MAX_ABS = 61440.0  # exclusive: 0x7B80 and up would round the high byte into inf (0x7C)
E4M3_WEIGHT_SCALE = 2.0**-8  # upper as E4M3FN holds 256 * w
E4M3_FNUZ_WEIGHT_SCALE = 2.0**-7  # the same byte read as E4M3FNUZ is value / 2
E5M2_WEIGHT_SCALE = 1.0
MAX_WEIGHT_EXP = 4  # prescale exponents 1..4 cover max|w| up to 16 * 1.8192 ~ 29.1


class Nesting(IntEnum):
    """How a layer's fp16 weight is split; the integer is what the custom ops take."""

    NONE = 0
    E4M3 = 1
    E5M2 = 2


def _bits(w: torch.Tensor) -> torch.Tensor:
    """fp16 -> its bit pattern as int32 in [0, 65535]."""
    if w.dtype != torch.float16:
        raise TypeError(f"expected an fp16 tensor, got {w.dtype}")
    return w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.float16)  # int32 -> int16 wraps, which is what we want


def _bytes(u8: torch.Tensor) -> torch.Tensor:
    if u8.dtype != torch.uint8:
        raise TypeError(f"expected a uint8 plane, got {u8.dtype}")
    return u8.to(torch.int32)


def split_e4m3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 ``w`` (all |w| <= 1.8192) -> (upper, lower) uint8 planes of the same shape."""
    a = _bits(w)
    sign, exp4, m1, m2 = a >> 15, (a >> 10) & 0xF, (a >> 7) & 0x7, a & 0x7F
    truncated = (sign << 7) | (exp4 << 3) | m1
    round_up = (m2 > 64) | ((m2 == 64) & ((m1 & 1) == 1))
    # 448 (e=15, m1=6) must not round into 0x7F, which is NaN in E4M3FN: saturate instead.
    round_up &= ~((exp4 == 15) & (m1 == 6))
    upper = (truncated + round_up.to(torch.int32)) & 0xFF  # the carry may ripple into the exponent
    return upper.to(torch.uint8), (a & 0xFF).to(torch.uint8)


def merge_e4m3(upper: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`split_e4m3` on eligible weights."""
    u, low = _bytes(upper), _bytes(lower)
    carry = low >> 7  # mantissa bit 7 is stored in both bytes
    hi = (u & 0x80) | (((u - carry) >> 1) & 0x3F)
    return _from_bits((hi << 8) | low)


def split_e5m2(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 ``w`` (all |w| < 61440) -> (upper, lower): upper = high byte rounded half away from zero."""
    a = _bits(w)
    hi, low = a >> 8, a & 0xFF
    # Saturation guard: 0x7B and above (magnitude) would round into inf / touch inf-NaN codes.
    may_round = (hi & 0x7F) < 0x7B
    upper = hi + ((low >> 7) & may_round.to(torch.int32))
    return upper.to(torch.uint8), low.to(torch.uint8)


def merge_e5m2(upper: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`split_e5m2` on eligible weights."""
    u, low = _bytes(upper), _bytes(lower)
    return _from_bits(((u - (low >> 7)) << 8) | low)


def check_weight_exp(weight_exp: int) -> int:
    if not 0 <= int(weight_exp) <= MAX_WEIGHT_EXP:
        raise ValueError(f"weight_exp must be in 0..{MAX_WEIGHT_EXP}, got {weight_exp}")
    return int(weight_exp)


def scale_pow2(w: torch.Tensor, exponent: int) -> torch.Tensor:
    """fp16 ``w * 2^exponent`` (through fp32: exact unless a result is subnormal and drops bits, or overflows)."""
    return w if exponent == 0 else (w.float() * 2.0**exponent).to(torch.float16)


def split(w: torch.Tensor, nesting: Nesting, weight_exp: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Planes of ``w * 2^-weight_exp`` (the caller checked that this scaling is exact, see ``choose_nesting``)."""
    w = scale_pow2(w, -check_weight_exp(weight_exp))
    if nesting == Nesting.E4M3:
        return split_e4m3(w)
    if nesting == Nesting.E5M2:
        return split_e5m2(w)
    raise ValueError(f"cannot split with nesting {nesting!r}")


def merge(upper: torch.Tensor, lower: torch.Tensor, nesting: Nesting, weight_exp: int = 0) -> torch.Tensor:
    """The fp16 weight ``merge(planes) * 2^weight_exp`` (bit-exact for planes from ``split`` of a checked layer)."""
    if nesting == Nesting.E4M3:
        w = merge_e4m3(upper, lower)
    elif nesting == Nesting.E5M2:
        w = merge_e5m2(upper, lower)
    else:
        raise ValueError(f"cannot merge with nesting {nesting!r}")
    return scale_pow2(w, check_weight_exp(weight_exp))


def upper_as_fp16(upper: torch.Tensor, nesting: Nesting, weight_exp: int = 0) -> torch.Tensor:
    """The fast-mode weight (approximately w) as fp16, by the same integer ops the kernels use.

    E4M3: ``((u & 0x80) << 8) | ((u & 0x7F) << 7)`` is the E4M3FN value / 256 (exact; same exponent field).
    E5M2: ``u << 8`` is the E5M2 value itself. Then times ``2^weight_exp`` (exact: |value / 256| <= 1.75).
    """
    u = _bytes(upper)
    if nesting == Nesting.E4M3:
        value = _from_bits(((u & 0x80) << 8) | ((u & 0x7F) << 7))
    elif nesting == Nesting.E5M2:
        value = _from_bits(u << 8)
    else:
        raise ValueError(f"no upper plane for nesting {nesting!r}")
    return scale_pow2(value, check_weight_exp(weight_exp))


def upper_as_fp8(upper: torch.Tensor, nesting: Nesting, weight_exp: int = 0) -> tuple[torch.Tensor, float]:
    """The upper plane viewed as its FP8 dtype (zero-copy) and the scale that turns it into w."""
    prescale = 2.0 ** check_weight_exp(weight_exp)
    if nesting == Nesting.E4M3:
        return upper.view(torch.float8_e4m3fn), E4M3_WEIGHT_SCALE * prescale
    if nesting == Nesting.E5M2:
        return upper.view(torch.float8_e5m2), E5M2_WEIGHT_SCALE * prescale
    raise ValueError(f"no upper plane for nesting {nesting!r}")


class NestingChoice(NamedTuple):
    """What ``choose_nesting`` decided: the nesting, the prescale exponent (planes hold ``w * 2^-weight_exp``)
    and why (for the nesting report)."""

    nesting: Nesting
    weight_exp: int
    reason: str


def _prescale_round_trips(w: torch.Tensor, weight_exp: int) -> bool:
    """``merge(split(w * 2^-s)) * 2^s == w`` bit for bit (signed zeros included) for E4M3 with prescale ``s``."""
    scaled = scale_pow2(w, -weight_exp)
    if float(scaled.abs().max()) > E4M3_MAX_ABS:
        return False
    upper, lower = split_e4m3(scaled)
    return torch.equal(_bits(merge(upper, lower, Nesting.E4M3, weight_exp)), _bits(w))


def _e4m3_prescale(w: torch.Tensor, amax: float) -> int | None:
    """The smallest exponent in 1..MAX_WEIGHT_EXP that brings ``w`` into E4M3 range exactly, or None."""
    for exp in range(1, MAX_WEIGHT_EXP + 1):
        if amax * 2.0**-exp <= E4M3_MAX_ABS and _prescale_round_trips(w, exp):
            return exp
    return None


def choose_nesting(w: torch.Tensor) -> NestingChoice:
    """Pick the nesting (and E4M3 prescale exponent) for one fp16 weight."""
    if w.dtype != torch.float16:
        return NestingChoice(Nesting.NONE, 0, f"dtype {w.dtype} is not fp16")
    if w.numel() == 0:
        return NestingChoice(Nesting.NONE, 0, "empty weight")
    if not bool(torch.isfinite(w).all()):
        return NestingChoice(Nesting.NONE, 0, "weight has inf/NaN")
    amax = float(w.abs().max())
    if amax <= E4M3_MAX_ABS:
        return NestingChoice(Nesting.E4M3, 0, f"max|w| = {amax:.4g} <= {E4M3_MAX_ABS}")
    exp = _e4m3_prescale(w, amax)
    if exp is not None:
        return NestingChoice(Nesting.E4M3, exp, f"max|w| = {amax:.4g}: E4M3 with exact prescale 2^-{exp}")
    if amax < E5M2_MAX_ABS:
        why = "no exact E4M3 prescale" if amax <= E4M3_MAX_ABS * 2**MAX_WEIGHT_EXP else "beyond E4M3 prescale range"
        return NestingChoice(Nesting.E5M2, 0, f"max|w| = {amax:.4g} in ({E4M3_MAX_ABS}, {E5M2_MAX_ABS:g}), {why}")
    return NestingChoice(Nesting.NONE, 0, f"max|w| = {amax:.4g} >= {E5M2_MAX_ABS:g}: E5M2 rounding would saturate")


def bf16_to_fp16_checked(w: torch.Tensor) -> torch.Tensor | None:
    """Cast bf16 -> fp16 when it is exact for every element, else None (the layer stays bf16, unnested).

    Exact iff each nonzero |x| is in [2^-17, 65504] or a multiple of 2^-24 (bf16 has 8 significant bits,
    fp16's finest spacing is 2^-24). Checking the round trip tests exactly that, and rejects inf/NaN too.
    """
    if w.dtype != torch.bfloat16:
        raise TypeError(f"expected bf16, got {w.dtype}")
    as_fp16 = w.to(torch.float16)
    return as_fp16 if torch.equal(as_fp16.to(torch.float32), w.to(torch.float32)) else None
