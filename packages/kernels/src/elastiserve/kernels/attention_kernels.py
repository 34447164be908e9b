"""Triton kernels of the elastic paged attention (launched from ``attention.py``).

One program handles (sequence, kv head, query tile or KV split). Its rows are (query token, q head of the GQA
group) pairs, ``BLOCK_M`` of them padded to at least 16 for ``tl.dot``. KV is walked pair by pair (logical blocks
2p, 2p+1), several pairs per iteration so that enough loads are in flight:

- MODE 0 (TARGET): two fp16 block tiles per pair, plain loads.
- MODE 1 (BASE): one packed tile per pair; A = ``w & 0xFF00``, B = ``w << 8`` (exact E5M2 values), half the bytes.
- MODE 2 (general): per-row pair mode; B rows of BASE pairs are masked off (no load issued) and both halves are
  decoded from the A tile with ``tl.where``.

Decode with KV splits (flash-decoding) writes per-split partials; the last program of each (sequence, kv head) to
finish merges them in the same launch (attention_merge.py). PATH 3 and 4 are the two launches of the split
structured path (``attention.STRUCTURED_SPLIT``): the TARGET ranges, then the BASE run, whose last program merges
the partials of both launches. The one-launch structured kernel carries both loops and compiles to 189 registers per
thread (2 CTAs per SM) against the native kernel's 114 (benchmarks/kernels/results/sm90-compile-report.log, head_dim
specialized as a multiple of 16 as the JIT does for 128: every loop then gets async copies; unspecialized, 203
against 158-209 registers and no loop pipelined).

Measured on the H200 (decode, batch 64 x 4096 tokens, 32 q / 8 kv heads, dim 128, graph replay): native 244 us
against SDPA's 238 us on contiguous KV; all-BASE 215 us, so BASE is latency-bound, not byte-bound. Why is not
measured: session 3 put it on the integer ops between its loads and the dots, from an unspecialized compile in which
no loop was pipelined, while the specialized compile the GPU runs pipelines them (session 21). A register-prefetch
variant and a swapped-operand (K as the dot's A operand) variant were both slower.

Scores use exp2 with the softmax scale folded into ``qk_scale`` (scale * log2 e); the running max starts at a large
finite negative so fully masked tiles give alpha = 1 and p = 0 instead of NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from elastiserve.kernels.arrivals import last_to_arrive
from elastiserve.kernels.attention_base_tile import attend_base_sliced, unpack_base
from elastiserve.kernels.attention_merge import NEG_BIG, merge_partials
from elastiserve.kernels.launch import wait_for_prior_grid


@triton.jit
def _online_softmax_step(acc, m_i, l_i, q, k_a, k_b, v_a, v_b, ok_a, ok_b, qk_scale):
    s_a = tl.where(ok_a, tl.dot(q, tl.trans(k_a)) * qk_scale, float("-inf"))
    s_b = tl.where(ok_b, tl.dot(q, tl.trans(k_b)) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.maximum(tl.max(s_a, 1), tl.max(s_b, 1)))
    p_a = tl.exp2(s_a - m_new[:, None])
    p_b = tl.exp2(s_b - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p_a, 1) + tl.sum(p_b, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p_a.to(v_a.dtype), v_a, acc)
    acc = tl.dot(p_b.to(v_b.dtype), v_b, acc)
    return acc, m_new, l_i


@triton.jit
def _tile_rows(first_pair, seq_len, pair_end, gap_at, gap_len, BLOCK_SIZE: tl.constexpr, PAIRS: tl.constexpr,
               GAP: tl.constexpr):
    """Rows of a tile of PAIRS pairs: row r is token r % BS of logical blocks A and B of pair first + r // BS.
    With GAP the pair indices are virtual: pairs from ``gap_at`` on are shifted by ``gap_len`` (one loop over the
    two TARGET ranges around a BASE run)."""
    rows = tl.arange(0, PAIRS * BLOCK_SIZE)
    virtual = first_pair + rows // BLOCK_SIZE
    in_range = virtual < pair_end
    if GAP:
        pair = virtual + tl.where(virtual >= gap_at, gap_len, 0)
    else:
        pair = virtual
    offset = rows % BLOCK_SIZE
    pos_a = pair * (2 * BLOCK_SIZE) + offset
    pos_b = pos_a + BLOCK_SIZE
    return pair, offset, pos_a, pos_b, in_range & (pos_a < seq_len), in_range & (pos_b < seq_len)


@triton.jit
def _pair_tile(
    acc, m_i, l_i, q, qpos, first_pair,
    kv_ptr, bt_row, pm_row,
    stride_block, stride_kv, stride_tok,
    seq_len, pair_end, head_dim, qk_scale, gap_at, gap_len,
    BLOCK_SIZE: tl.constexpr, PAIRS: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr, GAP: tl.constexpr,
    UNPACK_PTX: tl.constexpr,
):  # fmt: skip
    pair, offset, pos_a, pos_b, valid_a, valid_b = _tile_rows(first_pair, seq_len, pair_end, gap_at, gap_len,
                                                              BLOCK_SIZE, PAIRS, GAP)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    block_a = tl.load(bt_row + 2 * pair, mask=valid_a, other=0).to(tl.int64)
    k_tile_a = kv_ptr + block_a[:, None] * stride_block + offset[:, None] * stride_tok + dims[None, :]
    v_tile_a = k_tile_a + stride_kv
    k_mask_a = valid_a[:, None] & dim_ok[None, :]
    v_mask_a = k_mask_a
    if MODE == 1:
        k_a, k_b = unpack_base(tl.load(k_tile_a, mask=k_mask_a, other=0.0), UNPACK_PTX)
        v_a, v_b = unpack_base(tl.load(v_tile_a, mask=v_mask_a, other=0.0), UNPACK_PTX)
    else:
        if MODE == 2:
            base_row = tl.load(pm_row + pair, mask=valid_a, other=0) != 0
            read_b = valid_b & (base_row == 0)
        else:
            read_b = valid_b
        block_b = tl.load(bt_row + 2 * pair + 1, mask=read_b, other=0).to(tl.int64)
        k_tile_b = kv_ptr + block_b[:, None] * stride_block + offset[:, None] * stride_tok + dims[None, :]
        v_tile_b = k_tile_b + stride_kv
        k_mask_b = read_b[:, None] & dim_ok[None, :]
        v_mask_b = k_mask_b
        if MODE == 0:
            # fp16 straight into the dots: Triton pipelines these loads (any op in between, even a bitcast,
            # measured 40 % slower on the H200).
            k_a = tl.load(k_tile_a, mask=k_mask_a, other=0.0)
            v_a = tl.load(v_tile_a, mask=v_mask_a, other=0.0)
            k_b = tl.load(k_tile_b, mask=k_mask_b, other=0.0)
            v_b = tl.load(v_tile_b, mask=v_mask_b, other=0.0)
        else:
            is_base = base_row[:, None]
            if UNPACK_PTX:
                k_w = tl.load(k_tile_a, mask=k_mask_a, other=0.0)
                v_w = tl.load(v_tile_a, mask=v_mask_a, other=0.0)
                k_high, k_low = unpack_base(k_w, UNPACK_PTX)
                v_high, v_low = unpack_base(v_w, UNPACK_PTX)
                k_a = tl.where(is_base, k_high, k_w)
                v_a = tl.where(is_base, v_high, v_w)
                k_b = tl.where(is_base, k_low, tl.load(k_tile_b, mask=k_mask_b, other=0.0))
                v_b = tl.where(is_base, v_low, tl.load(v_tile_b, mask=v_mask_b, other=0.0))
            else:
                # selecting the 16-bit words before the bitcast: 178 registers, where selecting the unpacked fp16
                # values took 192 (sm90, head_dim specialized)
                k_w = tl.load(k_tile_a, mask=k_mask_a, other=0.0).to(tl.uint16, bitcast=True)
                v_w = tl.load(v_tile_a, mask=v_mask_a, other=0.0).to(tl.uint16, bitcast=True)
                k_wb = tl.load(k_tile_b, mask=k_mask_b, other=0.0).to(tl.uint16, bitcast=True)
                v_wb = tl.load(v_tile_b, mask=v_mask_b, other=0.0).to(tl.uint16, bitcast=True)
                k_a = tl.where(is_base, k_w & 0xFF00, k_w).to(tl.float16, bitcast=True)
                v_a = tl.where(is_base, v_w & 0xFF00, v_w).to(tl.float16, bitcast=True)
                k_b = tl.where(is_base, k_w << 8, k_wb).to(tl.float16, bitcast=True)
                v_b = tl.where(is_base, v_w << 8, v_wb).to(tl.float16, bitcast=True)
    ok_a = valid_a[None, :] & (pos_a[None, :] <= qpos[:, None])
    ok_b = valid_b[None, :] & (pos_b[None, :] <= qpos[:, None])
    return _online_softmax_step(acc, m_i, l_i, q, k_a, k_b, v_a, v_b, ok_a, ok_b, qk_scale)


@triton.jit
def _attend_pairs(
    acc, m_i, l_i, q, qpos,
    kv_ptr, bt_row, pm_row,
    stride_block, stride_kv, stride_tok,
    seq_len, pair_begin, pair_end, head_dim, qk_scale,
    BLOCK_SIZE: tl.constexpr, PAIRS: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr,
    INTERPRETED: tl.constexpr, UNPACK_PTX: tl.constexpr, gap_at=0, gap_len=0, GAP: tl.constexpr = False,
):  # fmt: skip
    """Attend to pairs [pair_begin, pair_end), PAIRS per iteration, all read in MODE (virtual pairs with GAP)."""
    if INTERPRETED:
        # The interpreter cannot take runtime tensors as range() bounds with numpy >= 2.4; GPU code keeps the
        # for loop, which Triton software-pipelines (a while loop it does not).
        first_pair = pair_begin
        while first_pair < pair_end:
            acc, m_i, l_i = _pair_tile(
                acc, m_i, l_i, q, qpos, first_pair, kv_ptr, bt_row, pm_row, stride_block, stride_kv,
                stride_tok, seq_len, pair_end, head_dim, qk_scale, gap_at, gap_len, BLOCK_SIZE, PAIRS, BLOCK_D, MODE,
                GAP, UNPACK_PTX,
            )  # fmt: skip
            first_pair += PAIRS
    else:
        for first_pair in range(pair_begin, pair_end, PAIRS):
            acc, m_i, l_i = _pair_tile(
                acc, m_i, l_i, q, qpos, first_pair, kv_ptr, bt_row, pm_row, stride_block, stride_kv,
                stride_tok, seq_len, pair_end, head_dim, qk_scale, gap_at, gap_len, BLOCK_SIZE, PAIRS, BLOCK_D, MODE,
                GAP, UNPACK_PTX,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _base_range_in(bounds_ptr, seq, lo, hi):
    """Sequence ``seq``'s BASE run ``base_bounds[seq] = [first, end)`` clipped to the pairs [lo, hi) of a program."""
    first_base = tl.load(bounds_ptr + 2 * seq)
    end_base = tl.maximum(tl.load(bounds_ptr + 2 * seq + 1), first_base)
    base_lo = tl.minimum(tl.maximum(first_base, lo), hi)
    return base_lo, tl.maximum(tl.minimum(end_base, hi), base_lo)


@triton.jit
def _pairs_per_split(num_pairs, NUM_SPLITS: tl.constexpr, SPLIT_ALIGN: tl.constexpr):
    """Pairs in each of NUM_SPLITS ranges over ``num_pairs``, a multiple of SPLIT_ALIGN (the last range may be short
    and trailing ranges empty: the split count is fixed by shapes for graph capture, the ranges follow seq_len)."""
    return tl.cdiv(tl.cdiv(num_pairs, NUM_SPLITS), SPLIT_ALIGN) * SPLIT_ALIGN


@triton.jit
def paged_attention_kernel(
    q_ptr, out_ptr, kv_ptr,
    bt_ptr, seq_lens_ptr, qsl_ptr, bounds_ptr, pm_ptr,
    part_acc_ptr, part_ml_ptr, counters_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_block, stride_kv, stride_head, stride_tok,
    stride_bt, stride_pm,
    group_size, head_dim, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    PAIRS: tl.constexpr, BASE_PAIRS: tl.constexpr, PATH: tl.constexpr, NUM_SPLITS: tl.constexpr,
    INTERPRETED: tl.constexpr, PARTIALS: tl.constexpr, TOTAL_SPLITS: tl.constexpr, SPLIT_BASE: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr, MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr, PDL: tl.constexpr = False,
    UNPACK_PTX: tl.constexpr = False, BASE_SLICES: tl.constexpr = 0,
):  # fmt: skip
    """With PARTIALS each program writes its split's (acc, max, sum) to slot SPLIT_BASE + split of its (sequence,
    kv head); with MERGE the last program of a (sequence, kv head) to finish (``counters_ptr``, arrivals.py)
    then merges the filled ones of its TOTAL_SPLITS slots into the output: decode in one launch."""
    wait_for_prior_grid(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if PARTIALS:
        split = tl.program_id(2)
        q_block = 0
    else:
        split = 0
        q_block = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_block * BLOCK_Q < q_len:
        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        q_idx, token, head, row_ok = _row_coords(rows, q_block, q_start, q_len, kv_head, group_size, BLOCK_Q)
        io_mask = row_ok[:, None] & (dims[None, :] < head_dim)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=io_mask)
        qpos = seq_len - q_len + q_idx

        # Pairs this program reads: up to the last query of its tile, cut into NUM_SPLITS tile-aligned ranges.
        kv_end = tl.minimum(seq_len, seq_len - q_len + (q_block + 1) * BLOCK_Q)
        num_pairs = tl.cdiv(kv_end, 2 * BLOCK_SIZE)
        per_split = _pairs_per_split(num_pairs, NUM_SPLITS, SPLIT_ALIGN)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, num_pairs)

        kv_layer = kv_ptr + kv_head * stride_head
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        pm_row = pm_ptr + seq.to(tl.int64) * stride_pm
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        used_base = 0  # filled BASE slots after the first NUM_SPLITS, for the merge (PATH 4 only)
        if PATH == 0:
            acc, m_i, l_i = _attend_pairs(
                acc, m_i, l_i, q, qpos, kv_layer, bt_row, pm_row, stride_block, stride_kv, stride_tok,
                seq_len, lo, hi, head_dim, qk_scale, BLOCK_SIZE, PAIRS, BLOCK_D, 0, INTERPRETED, UNPACK_PTX,
            )  # fmt: skip
        elif PATH == 1:
            # TARGET [lo, base_lo) / BASE [base_lo, base_hi) / TARGET [base_hi, hi): no per-pair lookups.
            base_lo, base_hi = _base_range_in(bounds_ptr, seq, lo, hi)
            acc, m_i, l_i = _attend_pairs(
                acc, m_i, l_i, q, qpos, kv_layer, bt_row, pm_row, stride_block, stride_kv, stride_tok,
                seq_len, lo, base_lo, head_dim, qk_scale, BLOCK_SIZE, PAIRS, BLOCK_D, 0, INTERPRETED, UNPACK_PTX,
            )  # fmt: skip
            acc, m_i, l_i = _attend_pairs(
                acc, m_i, l_i, q, qpos, kv_layer, bt_row, pm_row, stride_block, stride_kv, stride_tok,
                seq_len, base_lo, base_hi, head_dim, qk_scale, BLOCK_SIZE, BASE_PAIRS, BLOCK_D, 1, INTERPRETED,
                UNPACK_PTX,
            )  # fmt: skip
            acc, m_i, l_i = _attend_pairs(
                acc, m_i, l_i, q, qpos, kv_layer, bt_row, pm_row, stride_block, stride_kv, stride_tok,
                seq_len, base_hi, hi, head_dim, qk_scale, BLOCK_SIZE, PAIRS, BLOCK_D, 0, INTERPRETED, UNPACK_PTX,
            )  # fmt: skip
        elif PATH == 2:
            acc, m_i, l_i = _attend_pairs(
                acc, m_i, l_i, q, qpos, kv_layer, bt_row, pm_row, stride_block, stride_kv, stride_tok,
                seq_len, lo, hi, head_dim, qk_scale, BLOCK_SIZE, PAIRS, BLOCK_D, 2, INTERPRETED, UNPACK_PTX,
            )  # fmt: skip
        elif PATH == 3:
            # The TARGET side of a structured batch launched on its own: [lo, base_lo) and [base_hi, hi) as one
            # loop over virtual pairs that skips the BASE run (two loops compiled to 154 registers, sm90).
            base_lo, base_hi = _base_range_in(bounds_ptr, seq, lo, hi)
            acc, m_i, l_i = _attend_pairs(
                acc, m_i, l_i, q, qpos, kv_layer, bt_row, pm_row, stride_block, stride_kv, stride_tok,
                seq_len, lo, hi - (base_hi - base_lo), head_dim, qk_scale, BLOCK_SIZE, PAIRS, BLOCK_D, 0,
                INTERPRETED, UNPACK_PTX, base_lo, base_hi - base_lo, True,
            )  # fmt: skip
        else:
            # PATH 4, the BASE side: the BASE run [first, end) itself is cut into NUM_SPLITS ranges, so every
            # program of this launch reads BASE pairs (a kernel with only the BASE loop keeps its register count).
            first_base = tl.minimum(tl.load(bounds_ptr + 2 * seq), num_pairs)
            end_base = tl.minimum(tl.maximum(tl.load(bounds_ptr + 2 * seq + 1), first_base), num_pairs)
            per_base = tl.cdiv(tl.cdiv(end_base - first_base, NUM_SPLITS), BASE_PAIRS) * BASE_PAIRS
            b_lo = tl.minimum(first_base + split * per_base, end_base)
            b_hi = tl.minimum(b_lo + per_base, end_base)
            used_base = tl.cdiv(end_base - first_base, tl.maximum(per_base, 1))
            if BASE_SLICES > 0:
                acc, m_i, l_i = attend_base_sliced(
                    q, qpos, kv_layer, bt_row, stride_block, stride_kv, stride_tok, seq_len, b_lo, b_hi, head_dim,
                    qk_scale, BLOCK_M, BLOCK_SIZE, BLOCK_D, BASE_SLICES, UNPACK_PTX, INTERPRETED,
                )  # fmt: skip
            else:
                acc, m_i, l_i = _attend_pairs(
                    acc, m_i, l_i, q, qpos, kv_layer, bt_row, pm_row, stride_block, stride_kv, stride_tok, seq_len,
                    b_lo, b_hi, head_dim, qk_scale, BLOCK_SIZE, BASE_PAIRS, BLOCK_D, 1, INTERPRETED, UNPACK_PTX,
                )  # fmt: skip

        if PARTIALS:
            # A partial keeps the first MERGE_ROWS rows, which hold every query row: 4 of 16 at Llama-8B's GQA group
            # of 4. A bound known at compile time: masking by the runtime query rows (row_ok) took path 3's first
            # launch from 128 to 162 registers (sm90, head_dim not specialized); this mask leaves it at 128.
            first_slot = (seq * tl.num_programs(1) + kv_head) * TOTAL_SPLITS
            kept = rows < MERGE_ROWS
            part = part_acc_ptr + (first_slot + SPLIT_BASE + split).to(tl.int64) * (MERGE_ROWS * BLOCK_D)
            tl.store(part + rows[:, None] * BLOCK_D + dims[None, :], acc, mask=kept[:, None])
            ml = part_ml_ptr + (first_slot + SPLIT_BASE + split).to(tl.int64) * (2 * MERGE_ROWS)
            tl.store(ml + rows, m_i, mask=kept)
            tl.store(ml + MERGE_ROWS + rows, l_i, mask=kept)
            if MERGE:
                # Slots [0, FIRST_SPLITS) hold ranges of this kernel's own split (PATH 3's launch and paths 0-2);
                # only the first cdiv(num_pairs, per_split) hold pairs (a graph captured for 8,192 tokens keeps 16
                # splits, a 512-token context fills 8 native ones). PATH 4 adds its BASE ranges after them.
                # PATH 4's own split count (the grid's) may differ from the first launch's (SPLIT_BASE): its slots
                # and their fill follow that launch's ranges.
                FIRST_SPLITS: tl.constexpr = SPLIT_BASE if PATH == 4 else NUM_SPLITS
                used = tl.cdiv(num_pairs, tl.maximum(_pairs_per_split(num_pairs, FIRST_SPLITS, SPLIT_ALIGN), 1))
                counter = counters_ptr + seq * tl.num_programs(1) + kv_head
                if last_to_arrive(counter, NUM_SPLITS):
                    merge_rows = tl.arange(0, MERGE_ROWS)
                    _, out_token, out_head, out_ok = _row_coords(merge_rows, 0, q_start, q_len, kv_head, group_size,
                                                                 BLOCK_Q)
                    merged, merged_sum = merge_partials(part_acc_ptr, part_ml_ptr, first_slot, used, used_base,
                                                        merge_rows, out_ok, dims, FIRST_SPLITS, TOTAL_SPLITS, BLOCK_D,
                                                        MERGE_ROWS)
                    _store_out(out_ptr, merged, merged_sum, out_token, out_head, dims,
                               out_ok[:, None] & (dims[None, :] < head_dim), stride_ot, stride_oh)
                    # Every program of this (sequence, kv head) has arrived, so no one else touches the counter in
                    # this launch; the next launch reads it after this grid has finished (stream order, or PDL's
                    # griddepcontrol.wait, which waits for the whole grid and its memory).
                    tl.store(counter, 0)
        else:
            _store_out(out_ptr, acc, l_i, token, head, dims, io_mask, stride_ot, stride_oh)


@triton.jit
def _row_coords(rows, q_block, q_start, q_len, kv_head, group_size, BLOCK_Q: tl.constexpr):
    """Tile rows are (query of the tile, q head of the GQA group): query index, token, q head, and whether the row
    is a real query."""
    q_idx = q_block * BLOCK_Q + rows // group_size
    row_ok = (rows < BLOCK_Q * group_size) & (q_idx < q_len)
    return q_idx, (q_start + q_idx).to(tl.int64), kv_head * group_size + rows % group_size, row_ok


@triton.jit
def _store_out(out_ptr, acc, l_i, token, head, dims, io_mask, stride_ot, stride_oh):
    """The output rows acc / sum (zero where no key was visible)."""
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=io_mask)
