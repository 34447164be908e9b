"""The BASE side of the elastic attention: unpacking packed BASE words, and a BASE loop whose warps each keep their
own softmax state (``attend_base_sliced``).

In the kernel's shared tile loop (attention_kernels.py) a decode tile is 16 query rows by a few pairs' tokens, and
Triton lays the MMA's four warps along the tokens: every row max and row sum crosses warps through shared memory,
and P goes through shared memory to become the PV dot's A operand. In path 3's BASE launch that loop is issue-bound
(ncu on an H100, session 32: issue slots 42 % busy, 9.2 cycles between a warp's issues; sm90 SASS, session 33: 16
barriers an iteration). The sliced loop gives each warp a pair of its own: a 3-D tile [SLICES, rows, tokens] whose
batch dimension is the warps', so reductions stay inside a warp; the slices' (acc, max, sum) are merged once at the
end, as flash-decoding merges splits. On an H100 it was no faster (session 33: all-BASE at 64 x 4,096 in 195.3 us
with 2 slices, 206.8 with 4, against the shared loop's 194.1; BENCHMARKS.md), so it ships off
(``attention.BASE_LAUNCH_SLICES``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from elastiserve.kernels.attention_merge import NEG_BIG


@triton.jit
def unpack_base(words, PTX: tl.constexpr):
    """Packed BASE words, an fp16 tile as loaded (block A's byte high, block B's low), to the fp16 values of A
    (``w & 0xFF00``) and B (``w << 8``). On the GPU two words at a time in one 32-bit register: one LOP3 and one PRMT
    per two words, where Triton's 16-bit ops took an AND, a shift and two PRMTs to repack each pair for the MMA (sm90
    SASS of path 3's BASE loop: 535 -> 439 instructions an iteration, 104 -> 96 registers)."""
    if not PTX:
        bits = words.to(tl.uint16, bitcast=True)
        high = (bits & 0xFF00).to(tl.float16, bitcast=True)
        low = (bits << 8).to(tl.float16, bitcast=True)
    else:
        # prmt selector 0x2404: result bytes (0, w0.lo, 0, w1.lo), byte 4 being the zero operand's
        high, low = tl.inline_asm_elementwise(
            "{ .reg .b32 zero; mov.b32 zero, 0; and.b32 $0, $2, 0xFF00FF00; prmt.b32 $1, $2, zero, 0x2404; }",
            "=r,=r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2,
        )  # fmt: skip
    return high, low


@triton.jit
def attend_base_sliced(
    q, qpos, kv_ptr, bt_row, stride_block, stride_kv, stride_tok, seq_len, pair_begin, pair_end, head_dim, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, SLICES: tl.constexpr,
    UNPACK_PTX: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """(acc, max, sum) of the 16-row query tile ``q`` over the BASE pairs [pair_begin, pair_end), SLICES pairs an
    iteration, slice s taking pair first + s. BLOCK_SIZE >= 16 (``tl.dot``'s smallest N). Two pairs a slice took 255
    registers and spilled 80 bytes at 4 slices (sm90)."""
    slices = tl.arange(0, SLICES)
    offsets = tl.arange(0, BLOCK_SIZE)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q3 = tl.broadcast_to(q[None, :, :], (SLICES, BLOCK_M, BLOCK_D))
    acc = tl.zeros([SLICES, BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([SLICES, BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([SLICES, BLOCK_M], dtype=tl.float32)
    if INTERPRETED:
        first_pair = pair_begin
        while first_pair < pair_end:
            acc, m_i, l_i = _sliced_step(
                acc, m_i, l_i, q3, qpos, first_pair, slices, offsets, dims, dim_ok, kv_ptr, bt_row, stride_block,
                stride_kv, stride_tok, seq_len, pair_end, qk_scale, BLOCK_SIZE, UNPACK_PTX,
            )  # fmt: skip
            first_pair += SLICES
    else:
        for first_pair in range(pair_begin, pair_end, SLICES):
            acc, m_i, l_i = _sliced_step(
                acc, m_i, l_i, q3, qpos, first_pair, slices, offsets, dims, dim_ok, kv_ptr, bt_row, stride_block,
                stride_kv, stride_tok, seq_len, pair_end, qk_scale, BLOCK_SIZE, UNPACK_PTX,
            )  # fmt: skip
    # one merge of the slices, as of flash-decoding splits: an empty slice has max NEG_BIG and sum 0
    m_all = tl.max(m_i, 0)
    weight = tl.exp2(m_i - m_all[None, :])
    l_all = tl.sum(l_i * weight, 0)
    acc_all = tl.sum(acc * weight[:, :, None], 0)
    return acc_all, m_all, l_all


@triton.jit
def _sliced_step(
    acc, m_i, l_i, q3, qpos, first_pair, slices, offsets, dims, dim_ok, kv_ptr, bt_row, stride_block, stride_kv,
    stride_tok, seq_len, pair_end, qk_scale, BLOCK_SIZE: tl.constexpr, UNPACK_PTX: tl.constexpr,
):  # fmt: skip
    pair = first_pair + slices
    in_range = pair < pair_end
    pos_a = pair[:, None] * (2 * BLOCK_SIZE) + offsets[None, :]  # [SLICES, BLOCK_SIZE]
    pos_b = pos_a + BLOCK_SIZE
    valid_a = in_range[:, None] & (pos_a < seq_len)
    valid_b = in_range[:, None] & (pos_b < seq_len)
    block = tl.load(bt_row + 2 * pair, mask=in_range, other=0).to(tl.int64)
    k_tile = kv_ptr + block[:, None, None] * stride_block + offsets[None, :, None] * stride_tok + dims[None, None, :]
    mask = valid_a[:, :, None] & dim_ok[None, None, :]
    k_a, k_b = unpack_base(tl.load(k_tile, mask=mask, other=0.0), UNPACK_PTX)
    v_a, v_b = unpack_base(tl.load(k_tile + stride_kv, mask=mask, other=0.0), UNPACK_PTX)
    ok_a = valid_a[:, None, :] & (pos_a[:, None, :] <= qpos[None, :, None])
    ok_b = valid_b[:, None, :] & (pos_b[:, None, :] <= qpos[None, :, None])
    s_a = tl.where(ok_a, tl.dot(q3, tl.permute(k_a, (0, 2, 1))) * qk_scale, float("-inf"))
    s_b = tl.where(ok_b, tl.dot(q3, tl.permute(k_b, (0, 2, 1))) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.maximum(tl.max(s_a, 2), tl.max(s_b, 2)))
    p_a = tl.exp2(s_a - m_new[:, :, None])
    p_b = tl.exp2(s_b - m_new[:, :, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p_a, 2) + tl.sum(p_b, 2)
    acc = acc * alpha[:, :, None]
    acc = tl.dot(p_a.to(v_a.dtype), v_a, acc)
    acc = tl.dot(p_b.to(v_b.dtype), v_b, acc)
    return acc, m_new, l_i
