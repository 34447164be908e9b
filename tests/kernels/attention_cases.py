"""Paged attention test cases: a batch builder that writes and demotes through the reference ops, and the dense
per-request SDPA check on the gathered K/V (shared by the CPU and the CUDA-only attention tests)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from elastiserve.kernels.attention import paged_attention, paged_attention_ref
from elastiserve.kernels.attention_plan import AttentionPlanBuffers, AttentionPlanConfig, plan_attention
from elastiserve.kernels.kv_ops import kv_demote_ref, kv_write_ref

LAYER = 1


@dataclass
class PagedBatch:
    q: torch.Tensor
    cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    dense_k: list[torch.Tensor]  # per sequence [L, Hkv, D], BASE pairs already E5M2-rounded
    dense_v: list[torch.Tensor]
    pair_modes: list[np.ndarray]


def rna_e5m2(x: torch.Tensor) -> torch.Tensor:
    """BASE value of fp16 x, computed here independently: high byte rounded half away from zero."""
    bits = x.view(torch.int16).to(torch.int32) % 65536
    high = (bits // 256 + (bits % 256 >= 128).to(torch.int32)) % 256
    signed = torch.where(high >= 128, high * 256 - 65536, high * 256)
    return signed.to(torch.int16).view(torch.float16)


def build_batch(device, seq_lens, q_lens, base_pairs, *, kv_heads=2, group=3, head_dim=24, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    cache = torch.randn(num_blocks, 2, 2, kv_heads, block_size, head_dim, generator=gen).half()
    physical = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    dense_k, dense_v, pair_modes, slots, to_demote = [], [], [], [], []
    used = 0
    for seq, (seq_len, nb, base) in enumerate(zip(seq_lens, blocks_per_seq, base_pairs)):
        table[seq, :nb] = physical[used : used + nb].int()
        used += nb
        key = torch.randn(seq_len, kv_heads, head_dim, generator=gen).half()
        value = torch.randn(seq_len, kv_heads, head_dim, generator=gen).half()
        positions = torch.arange(seq_len)
        slots.append(table[seq, positions // block_size].long() * block_size + positions % block_size)
        modes = np.zeros(math.ceil(nb / 2), dtype=np.uint8)
        for pair in base:
            assert 2 * pair + 1 < nb, "a BASE pair needs both blocks"
            modes[pair] = 1
            to_demote.append((int(table[seq, 2 * pair]), int(table[seq, 2 * pair + 1])))
            in_pair = (positions // (2 * block_size)) == pair
            key[in_pair], value[in_pair] = rna_e5m2(key[in_pair]), rna_e5m2(value[in_pair])
        dense_k.append(key)
        dense_v.append(value)
        pair_modes.append(modes)
    # Write the fp16 values, then demote (the dense copies above already hold what BASE reads back).
    all_k = torch.cat([k for k in dense_k])
    all_v = torch.cat([v for v in dense_v])
    kv_write_ref(cache, LAYER, all_k, all_v, torch.cat(slots))
    if to_demote:
        pairs = torch.tensor(to_demote)
        low = torch.empty(len(to_demote), 2 * cache[0].numel(), dtype=torch.uint8)
        kv_demote_ref(cache, pairs[:, 0], pairs[:, 1], low)
        for seq, base in enumerate(base_pairs):
            for pair in base:
                table[seq, 2 * pair + 1] = table[seq, 2 * pair]
    qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), kv_heads * group, head_dim, generator=gen).half()
    return PagedBatch(
        q.to(device), cache.to(device), table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
        qsl.to(device), max(q_lens), [k.to(device) for k in dense_k], [v.to(device) for v in dense_v], pair_modes,
    )  # fmt: skip


def dense_sdpa(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Per-request dense check, the way flashinfer's tests do it."""
    out = torch.zeros_like(batch.q, dtype=torch.float32)
    starts = batch.query_start_loc.tolist()
    group = batch.q.shape[1] // batch.dense_k[0].shape[1]
    for seq, (key, value) in enumerate(zip(batch.dense_k, batch.dense_v)):
        begin, end = starts[seq], starts[seq + 1]
        q_len, seq_len = end - begin, key.shape[0]
        q = batch.q[begin:end].float().transpose(0, 1)[None]
        k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)[None]
        v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)[None]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        out[begin:end] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[0].transpose(0, 1)
    return out


def metadata(batch: PagedBatch, device, path: int | None = None):
    max_batch, max_pairs = len(batch.pair_modes) + 1, max(len(m) for m in batch.pair_modes) + 1
    buffers = AttentionPlanBuffers(AttentionPlanConfig(max_batch, max_pairs), device)
    plan = plan_attention(batch.pair_modes, buffers)
    if path is None or path == plan.path:
        return plan.path, plan.base_bounds, plan.pair_mode
    # Force a wider path over the same modes: the general table is always valid, bounds only if T*B*T*.
    bounds = torch.zeros(max_batch, 2, dtype=torch.int32)
    modes = torch.zeros(max_batch, max_pairs, dtype=torch.uint8)
    for seq, flags in enumerate(batch.pair_modes):
        modes[seq, : len(flags)] = torch.from_numpy(flags)
        where = np.flatnonzero(flags)
        if where.size:
            bounds[seq] = torch.tensor([where[0], where[-1] + 1])
    return path, bounds.to(device), modes.to(device)


def run_attention(batch, path, bounds, modes, *, scale=0.37, num_splits=0, ref=False):
    fn = paged_attention_ref if ref else paged_attention
    return fn(
        batch.q, batch.cache, LAYER, batch.block_tables, batch.seq_lens, batch.query_start_loc,
        base_bounds=bounds, pair_mode=modes, scale=scale, max_query_len=batch.max_query_len, path=path,
        **({} if ref else {"num_splits": num_splits}),
    )  # fmt: skip


