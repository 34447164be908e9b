"""Register-level decode of nested weight tiles, shared by the dense and grouped GEMM kernels.

``decode_weight_tile`` is portable (integer ops per element: on the H200 full mode's ~9 ops per weight bound the
decode-size GEMM at 0.43-0.49x of fp16 while the same loop without decode ops ran at 1.1-1.25x,
benchmarks/kernels/results/h200-gemm-config-probe.json). ``decode_weight_tile_ptx`` does the same on NVIDIA GPUs four
weights at a time: Triton packs four bytes of each plane into one 32-bit register, the carry subtraction runs on the
packed word (an upper byte that was rounded up is >= 1 in its magnitude bits, so no borrow crosses bytes) and two
``prmt`` byte permutes interleave upper and lower bytes into two fp16x2 words: ~2-3 instructions per weight.
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAIN = 3  # load_weight_tile's MODE for a plain fp16 weight (no planes, nothing to decode)

# Operands: $0, $1 = two fp16x2 results (weights 0,1 and 2,3 of the pack); $2 = four upper bytes; $3 = four lower
# bytes. prmt selector 0x5140 picks bytes (l0, u0, l1, u1) of {a = lower, b = decoded upper}, 0x7362 (l2, u2, l3, u3).
_FULL_E4M3_PTX = tl.constexpr("""{
.reg .b32 c, t, h;
shr.b32 c, $3, 7;
and.b32 c, c, 0x01010101;
sub.u32 t, $2, c;
shr.b32 t, t, 1;
and.b32 t, t, 0x3F3F3F3F;
and.b32 h, $2, 0x80808080;
or.b32 h, h, t;
prmt.b32 $0, $3, h, 0x5140;
prmt.b32 $1, $3, h, 0x7362;
}""")
_FULL_E5M2_PTX = tl.constexpr("""{
.reg .b32 c, h;
shr.b32 c, $3, 7;
and.b32 c, c, 0x01010101;
sub.u32 h, $2, c;
prmt.b32 $0, $3, h, 0x5140;
prmt.b32 $1, $3, h, 0x7362;
}""")
# Weight-only: E4M3 byte s.eeee.mmm / 256 as fp16 is s.0eeee.mmm0000000 -> high byte s|(u>>1 & 0x3F), low byte
# (u & 1) << 7; E5M2 is the high byte of fp16 itself (low byte zero). $2 = four upper bytes.
_FAST_E4M3_PTX = tl.constexpr("""{
.reg .b32 t, h, l;
shr.b32 t, $2, 1;
and.b32 t, t, 0x3F3F3F3F;
and.b32 h, $2, 0x80808080;
or.b32 h, h, t;
shl.b32 l, $2, 7;
and.b32 l, l, 0x80808080;
prmt.b32 $0, l, h, 0x5140;
prmt.b32 $1, l, h, 0x7362;
}""")
_FAST_E5M2_PTX = tl.constexpr("""{
prmt.b32 $0, 0, $2, 0x5040;
prmt.b32 $1, 0, $2, 0x7060;
}""")


@triton.jit
def decode_weight_tile(u, low, MODE: tl.constexpr, NESTING: tl.constexpr, FNUZ: tl.constexpr):
    """uint8 upper (and lower) tiles -> the tile tl.dot consumes (fp16, or fp8 for MODE == FP8)."""
    if MODE == 0:
        u16 = u.to(tl.uint16)
        l16 = low.to(tl.uint16)
        carry = l16 >> 7
        if NESTING == 1:  # E4M3: mantissa bit 7 is in both bytes; the top exponent bit is known zero
            hi = (u16 & 0x80) | (((u16 - carry) >> 1) & 0x3F)
        else:  # E5M2: upper was rounded half away from zero
            hi = u16 - carry
        return ((hi << 8) | l16).to(tl.float16, bitcast=True)
    elif MODE == 1:
        u16 = u.to(tl.uint16)
        if NESTING == 1:  # E4M3FN value / 256 (~ w): same exponent field as fp16 with E[4] = 0
            bits = ((u16 & 0x80) << 8) | ((u16 & 0x7F) << 7)
        else:
            bits = u16 << 8
        return bits.to(tl.float16, bitcast=True)
    else:
        if FNUZ:
            v = tl.where(u == 0x80, 0, u).to(tl.uint8)  # -0 in OCP is NaN in FNUZ
            if NESTING == 1:
                return v.to(tl.float8e4b8, bitcast=True)
            return v.to(tl.float8e5b16, bitcast=True)
        return u  # the launcher passed the plane already viewed as its OCP fp8 dtype: no register bitcast


@triton.jit
def decode_weight_tile_ptx(u, low, MODE: tl.constexpr, NESTING: tl.constexpr):
    """``decode_weight_tile`` for MODE full (0) and weight-only (1) on NVIDIA GPUs, four weights per asm call."""
    if MODE == 0:
        if NESTING == 1:
            return tl.inline_asm_elementwise(_FULL_E4M3_PTX, "=r,=r,r,r", [u, low], dtype=tl.float16, is_pure=True,
                                             pack=4)
        return tl.inline_asm_elementwise(_FULL_E5M2_PTX, "=r,=r,r,r", [u, low], dtype=tl.float16, is_pure=True,
                                         pack=4)
    if NESTING == 1:
        return tl.inline_asm_elementwise(_FAST_E4M3_PTX, "=r,=r,r", [u], dtype=tl.float16, is_pure=True, pack=4)
    return tl.inline_asm_elementwise(_FAST_E5M2_PTX, "=r,=r,r", [u], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def load_weight_tile(upper_ptr, lower_ptr, offs_n, offs_k, stride_wn, stride_wk, stride_ln, stride_lk, w_mask,
                     MODE: tl.constexpr, NESTING: tl.constexpr, FNUZ: tl.constexpr, PTX_DECODE: tl.constexpr):
    """Load one [BLOCK_N, BLOCK_K] tile of the planes (the lower one only in full mode) and decode it for tl.dot.
    MODE 3 (``PLAIN``): ``upper_ptr`` is a plain fp16 weight, loaded as it is (the grouped GEMM of unnested experts)."""
    w_off = offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    if MODE == 3:
        return tl.load(upper_ptr + w_off, mask=w_mask, other=0.0)
    if MODE == 2 and not FNUZ:  # fp8 pointer
        u = tl.load(upper_ptr + w_off, mask=w_mask, other=0.0)
    else:
        u = tl.load(upper_ptr + w_off, mask=w_mask, other=0)
    if MODE == 0:
        low = tl.load(lower_ptr + offs_n[:, None] * stride_ln + offs_k[None, :] * stride_lk, mask=w_mask, other=0)
    else:
        low = u
    if PTX_DECODE and MODE != 2:
        return decode_weight_tile_ptx(u, low, MODE, NESTING)  # four weights per asm call
    return decode_weight_tile(u, low, MODE, NESTING, FNUZ)
