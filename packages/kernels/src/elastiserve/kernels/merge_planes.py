"""Rebuild the exact fp16 weight from its two byte planes, four weights per 32-bit word.

Full-mode GEMMs with many rows are compute bound, and rebuilding the weight inside the GEMM repeats the integer
decode once per row tile: on the H200 the fused kernel ran at 0.12-0.38x of cuBLAS fp16 for M >= 256
(benchmarks/kernels/results/h200-nested-gemm-run1.json). Decoding the layer once into a scratch fp16 weight (read 2
bytes, write 2 bytes per weight) and handing it to the vendor GEMM costs one memory-bound pass instead.

The decode runs on packed words: the per-byte carry subtraction never borrows across bytes (an upper byte that was
rounded up is at least 1 in its magnitude bits), so one 32-bit subtract serves four weights.

``full_via_merged_weight`` is full mode's path for many rows (``configs.MATERIALIZE_MIN_M``): the merge, then the
vendor fp16 GEMM. Merging in L2-sized slices of weight rows, so that the GEMM reads each slice from L2, was timed on
the H200 and lost at every shape and M from 96 to 1,024 rows (1.07-8x slower: two launches a slice and short cuBLAS
GEMMs; BENCHMARKS.md, kernels, session 25; code at 758da3c).

Registered op: ``elastiserve::merge_planes(upper, lower, nesting) -> fp16``; reference: ``formats.merge``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastiserve.kernels import formats
from elastiserve.kernels.formats import Nesting
from elastiserve.platforms import current_platform

_BLOCK_WORDS = 1024


@triton.jit
def _merge_planes_kernel(upper_ptr, lower_ptr, out_ptr, num_words, NESTING: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_words
    u = tl.load(upper_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    low = tl.load(lower_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    carry = (low >> 7) & 0x01010101
    if NESTING == 1:  # E4M3: sign stays, magnitude bits shift down one (the top exponent bit is zero)
        hi = (u & 0x80808080) | (((u - carry) >> 1) & 0x3F3F3F3F)
    else:  # E5M2: the upper byte was rounded half away from zero
        hi = u - carry
    # fp16 k = (hi byte k << 8) | low byte k; two fp16 per output word, little-endian.
    word01 = (low & 0xFF) | ((hi & 0xFF) << 8) | ((low & 0xFF00) << 8) | ((hi & 0xFF00) << 16)
    word23 = ((low >> 16) & 0xFF) | ((hi >> 8) & 0xFF00) | ((low >> 8) & 0xFF0000) | (hi & 0xFF000000)
    both = tl.reshape(tl.join(word01, word23), (2 * BLOCK,))
    out_offs = 2 * tl.program_id(0) * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_offs, both.to(tl.int32, bitcast=True), mask=out_offs < 2 * num_words)


def merge_planes(upper: torch.Tensor, lower: torch.Tensor, nesting: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """fp16 weight of the planes' shape (planes of ``w * 2^-weight_exp`` give that scaled weight)."""
    if upper.shape != lower.shape or upper.dtype != torch.uint8 or lower.dtype != torch.uint8:
        raise ValueError("upper and lower must be uint8 planes of one shape")
    if nesting not in (Nesting.E4M3, Nesting.E5M2):
        raise ValueError(f"nesting must be E4M3 or E5M2, got {nesting}")
    if out is None:
        out = torch.empty(upper.shape, dtype=torch.float16, device=upper.device)
    packed = upper.is_contiguous() and lower.is_contiguous() and upper.numel() % 4 == 0 and out.is_contiguous()
    if not packed or current_platform().kernel_backend == "reference":
        return out.copy_(formats.merge(upper, lower, Nesting(nesting)))
    num_words = upper.numel() // 4
    if num_words:
        _merge_planes_kernel[(triton.cdiv(num_words, _BLOCK_WORDS),)](
            upper.reshape(-1).view(torch.int32), lower.reshape(-1).view(torch.int32), out.reshape(-1).view(torch.int32),
            num_words,
            NESTING=int(nesting), BLOCK=_BLOCK_WORDS, num_warps=4)
    return out


@torch.library.custom_op("elastiserve::merge_planes", mutates_args=())
def merge_planes_op(upper: torch.Tensor, lower: torch.Tensor, nesting: int) -> torch.Tensor:
    return merge_planes(upper, lower, nesting)


@merge_planes_op.register_fake
def _(upper, lower, nesting):
    return upper.new_empty(upper.shape, dtype=torch.float16)


def full_via_merged_weight(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, bias: torch.Tensor | None,
                           nesting: int, weight_exp: int = 0) -> torch.Tensor:
    """Full mode for many rows: decode the exact fp16 weight once into scratch, then the vendor fp16 GEMM."""
    w = merge_planes(upper, lower, nesting)  # w * 2^-weight_exp, exact
    if weight_exp == 0:
        return torch.nn.functional.linear(x, w, bias)
    y = torch.mm(x, w.t()).mul_(2.0 ** formats.check_weight_exp(weight_exp))  # power of two: exact scaling
    return y if bias is None else y.add_(bias)
