"""Merging flash-decoding partials inside the attention launch (``paged_attention_kernel`` with MERGE): the program
of a (sequence, kv head) that finishes last merges every split's (acc, max, sum) into the output, so decode takes one
launch (the split-K semaphore pattern). A separate reduction kernel (8 programs at batch-1 Llama-8B decode, each
looping over the splits, each slot's loads issued after the previous slot's arithmetic) plus its launch cost 3-5 us
a layer; merged in the launch, batch-1 attention at a 512-token context in a graph for 8,192 tokens (16 splits, 8
filled) takes 5.1 us a call against 8.5 (H200, session 21, BENCHMARKS.md).

The protocol and why the last program sees every partial: ``arrivals.py`` (``last_to_arrive``); the counters are
``attention.split_counters``, zero before every launch and after it.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_BIG = tl.constexpr(-1.0e30)
MERGE_ROWS_IN_FLIGHT = tl.constexpr(32)  # partial rows (of BLOCK_D fp32) the merge loads at once


@triton.jit
def _partial_slot(k, used, NUM_SPLITS: tl.constexpr):
    """Slot of the k-th filled partial: the first ``used`` of the NUM_SPLITS ranges come first, then the BASE ranges
    of the split structured path's second launch, which start at slot NUM_SPLITS."""
    return tl.where(k < used, k, NUM_SPLITS + k - used)


@triton.jit
def _fold_slots(acc, m_run, l_run, part_acc_ptr, part_ml_ptr, first_slot, first, filled, used, rows, row_ok, dims,
                NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, MERGE_ROWS: tl.constexpr, AT_ONCE: tl.constexpr):
    """Fold filled partials ``first .. first + AT_ONCE`` into the running (acc, max, sum): their max first, then
    sum_s acc_s * exp2(m_s - max). The loops are unrolled and no slot's loads depend on another slot's arithmetic,
    so all their loads issue together (a runtime loop without tl.dot is not pipelined); a slot past ``filled``
    and a row past ``row_ok`` issue no memory access."""
    m_new = m_run
    for j in tl.static_range(AT_ONCE):
        slot = first_slot + _partial_slot(first + j, used, NUM_SPLITS)
        ml = part_ml_ptr + slot.to(tl.int64) * (2 * MERGE_ROWS) + rows
        m_new = tl.maximum(m_new, tl.load(ml, mask=row_ok & (first + j < filled), other=NEG_BIG))
    alpha = tl.exp2(m_run - m_new)
    acc = acc * alpha[:, None]
    l_run = l_run * alpha
    for j in tl.static_range(AT_ONCE):
        slot = first_slot + _partial_slot(first + j, used, NUM_SPLITS)
        ml = part_ml_ptr + slot.to(tl.int64) * (2 * MERGE_ROWS) + rows
        read = row_ok & (first + j < filled)
        # A slot that is not read weighs exp2(NEG_BIG - m_new) = 0 (1 on a row nothing fills) and adds zeros.
        weight = tl.exp2(tl.load(ml, mask=read, other=NEG_BIG) - m_new)
        l_run += tl.load(ml + MERGE_ROWS, mask=read, other=0.0) * weight
        part = part_acc_ptr + slot.to(tl.int64) * (MERGE_ROWS * BLOCK_D) + rows[:, None] * BLOCK_D + dims[None, :]
        acc += tl.load(part, mask=read[:, None], other=0.0) * weight[:, None]
    return acc, m_new, l_run


@triton.jit
def merge_partials(part_acc_ptr, part_ml_ptr, first_slot, used, used_base, rows, row_ok, dims,
                   NUM_SPLITS: tl.constexpr, TOTAL_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                   MERGE_ROWS: tl.constexpr):  # fmt: skip
    """(acc, sum) of ``rows`` (MERGE_ROWS of them: every query row of a decode tile) over the ``used + used_base``
    filled partials from ``first_slot`` on, AT_ONCE slots at a time: 32 partial rows in flight (32 registers a
    thread at BLOCK_D 128 and 4 warps). Compiled for sm90 the merge then peaks at 66 live registers, under the
    attention loop's 107; 64 rows in flight took path 3's BASE launch from 96 to 106 registers."""
    AT_ONCE: tl.constexpr = min((MERGE_ROWS_IN_FLIGHT + MERGE_ROWS - 1) // MERGE_ROWS, TOTAL_SPLITS)
    filled = used + used_base
    acc = tl.zeros([MERGE_ROWS, BLOCK_D], dtype=tl.float32)
    m_run = tl.full([MERGE_ROWS], NEG_BIG, dtype=tl.float32)
    l_run = tl.zeros([MERGE_ROWS], dtype=tl.float32)
    for group in tl.static_range((TOTAL_SPLITS + AT_ONCE - 1) // AT_ONCE):
        if group * AT_ONCE < filled:  # a branch per group: the next group's loads wait for this group's registers
            acc, m_run, l_run = _fold_slots(acc, m_run, l_run, part_acc_ptr, part_ml_ptr, first_slot,
                                            group * AT_ONCE, filled, used, rows, row_ok, dims, NUM_SPLITS, BLOCK_D,
                                            MERGE_ROWS, AT_ONCE)
    return acc, l_run
