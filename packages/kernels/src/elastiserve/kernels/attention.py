"""Unified varlen causal attention over the paged, mixed-fidelity KV cache (``elastiserve::paged_attention``).

Sequence ``b`` has ``seq_lens[b]`` KV tokens; its queries are the last ``q_len = qsl[b+1] - qsl[b]`` of them, so
query ``j`` sees KV positions ``<= seq_len - q_len + j``. That covers prefill, chunked prefill and decode in one op.
``path`` (chosen per batch by :func:`elastiserve.kernels.attention_plan.plan_attention`) says how pairs are read:
0 native (all TARGET), 1 structured (``base_bounds[b] = [first, end)`` BASE pairs), 2 general (``pair_mode``),
3 structured in two launches (same inputs as 1; the planner's choice for T*B*T* batches, attention_plan.py).
Decode with KV splits merges the splits inside the attention launch (attention_merge.py): one launch on paths 0-2,
two on path 3.
"""

from __future__ import annotations

import math

import torch
import triton

from elastiserve.kernels.arrivals import arrival_counters
from elastiserve.kernels.attention_kernels import paged_attention_kernel
from elastiserve.kernels.attention_plan import GENERAL, NATIVE, STRUCTURED, STRUCTURED_SPLIT
from elastiserve.kernels.kv_ops import KVLayoutError, base_halves, check_kv_cache
from elastiserve.kernels.launch import pdl_options
from elastiserve.platforms import Vendor, current_platform
from elastiserve.platforms.env import triton_interpret

LOG2_E = 1.4426950408889634
TARGET_PAIRS_PER_TILE = 2  # 2 pairs = 4 blocks of fp16 K and V in flight per iteration
BASE_PAIRS_PER_TILE = 4  # a BASE pair is one packed block: twice the pairs for the same bytes in flight
# The BASE-only launch of path 3 reads 2 pairs per tile: compiled for sm90 that kernel holds 96 registers per thread
# (5 CTAs per SM; the native kernel 114) where 4 pairs take 142 (3 CTAs per SM); sm90-compile-report.log, head_dim
# specialized as the JIT does for 128 (unspecialized: 128 against 204).
SPLIT_BASE_PAIRS_PER_TILE = 2
# Path 3's BASE launch: KV splits as a multiple of the first launch's, and a register cap (NVIDIA; None: the
# compiler's 104). Session 32's ncu of that launch at batch 64 x 4,096 (H100, BENCHMARKS.md): 512 programs, 3.9
# resident a SM (16 warps: 25 % occupancy), issue slots 42 % busy at 9.2 cycles between a warp's instructions, DRAM
# 82 % busy; more resident warps need both more programs and fewer registers (96 or fewer: 5 CTAs a SM, no spills;
# 80: 6, 8 bytes spilled). Kept at 1 / None until a sweep times them (bench_attention.py --sweep).
BASE_LAUNCH_SPLIT_FACTOR = 1
BASE_LAUNCH_MAX_REGISTERS: int | None = None
# BASE words unpacked two at a time by one LOP3 and one PRMT in 32-bit registers (inline PTX, NVIDIA only): the BASE
# loop of path 3's BASE launch drops from 535 to 439 instructions an iteration and from 104 to 96 registers (sm90,
# compile_report.py; 5 CTAs a SM instead of 4); path 2's from 178 to 168 registers. Bit-equal on an H100 (session 33),
# but all-BASE there ran 201.4 us against 194.1 with the 16-bit ops (bench_attention.py --sweep sliced): off, until an
# H200 (where the launch is shorter of issue slots) times it.
UNPACK_BASE_PTX = False
# Path 3's BASE launch with each warp on its own pairs and softmax state (attention_base_tile.attend_base_sliced),
# BASE_LAUNCH_SLICES warps of one pair each, merged once at the end; 0 keeps the shared tile loop. sm90 compile
# (session 33): 4 slices: 628 instructions an iteration for 128 tokens (19.6 warp-instructions a token against the
# shared loop's 27.4 with the PTX unpack, 33.4 without), only the pipeline's 2 barriers in the loop (16 in the shared
# one), but 185 registers (2 CTAs a SM against 5); 2 slices (2 warps): 180 registers, 5 CTAs a SM. On an H100
# (session 33, --sweep sliced, all-BASE at 64 x 4,096): 4 slices 206.8 us, 2 slices 195.3, against the shared loop's
# 194.1: off, until an H200 times it.
BASE_LAUNCH_SLICES = 0
MIN_PAIRS_PER_SPLIT = 8
MAX_SPLITS = 16
NUM_WARPS = 4
NUM_STAGES = 2


def base_launch_register_cap() -> dict:
    """Path 3's BASE launch option for ``BASE_LAUNCH_MAX_REGISTERS``: PTX .maxnreg on NVIDIA GPUs, none elsewhere
    (the interpreter and AMD have no such cap; the setting is a tuning knob of the CUDA launch only)."""
    if BASE_LAUNCH_MAX_REGISTERS is None or triton_interpret() or current_platform().vendor is not Vendor.NVIDIA:
        return {}
    return {"maxnreg": BASE_LAUNCH_MAX_REGISTERS}


def base_launch_slices(block_size: int) -> dict:
    """Path 3's BASE launch options for ``BASE_LAUNCH_SLICES``: one warp a slice. The sliced loop's dots take a
    block's tokens as their N, which ``tl.dot`` wants >= 16; smaller blocks keep the shared loop."""
    if BASE_LAUNCH_SLICES <= 0 or block_size < 16:
        return {}
    return {"BASE_SLICES": BASE_LAUNCH_SLICES, "num_warps": BASE_LAUNCH_SLICES}


def unpack_base_ptx() -> bool:
    """Whether the kernels unpack BASE words with inline PTX: ``UNPACK_BASE_PTX`` on an NVIDIA GPU; the interpreter
    and AMD take Triton's 16-bit ops (the same bits)."""
    return UNPACK_BASE_PTX and not triton_interpret() and current_platform().vendor is Vendor.NVIDIA


def split_counters(device: torch.device, entries: int) -> torch.Tensor:
    """int32 zeros of at least ``entries`` on ``device`` for ``paged_attention_kernel``'s ``counters_ptr``, one per
    (sequence, kv head) (``arrivals.arrival_counters``)."""
    return arrival_counters("attention", device, entries)


def choose_block_m(group_size: int, max_query_len: int) -> int:
    rows = triton.next_power_of_2(max(1, max_query_len) * group_size)
    return max(16, triton.next_power_of_2(group_size), min(rows, 64))


def choose_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, num_sms: int) -> int:
    """Flash-decoding split count: enough programs to fill the GPU about twice, never splits of under
    MIN_PAIRS_PER_SPLIT pairs. Depends only on shapes, so a captured CUDA graph keeps it."""
    programs = max(1, batch * num_kv_heads)
    wanted = triton.cdiv(2 * max(num_sms, 1), programs)
    max_pairs = triton.cdiv(max_blocks, 2)
    return max(1, min(wanted, max_pairs // MIN_PAIRS_PER_SPLIT, MAX_SPLITS))


def _check_inputs(q, kv_cache, block_tables, seq_lens, query_start_loc, path, base_bounds, pair_mode) -> None:
    check_kv_cache(kv_cache)
    if q.dim() != 3 or q.shape[2] != kv_cache.shape[5] or q.shape[1] % kv_cache.shape[3] != 0:
        raise KVLayoutError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)} (GQA needs Hq % Hkv)")
    if q.stride(-1) != 1:
        raise KVLayoutError("q must be contiguous in its last dimension")
    batch = seq_lens.shape[0]
    if block_tables.dtype != torch.int32 or block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise KVLayoutError("block_tables must be int32 [B, max_blocks] with unit stride along blocks")
    if seq_lens.dtype != torch.int32 or query_start_loc.dtype != torch.int32 or query_start_loc.shape[0] != batch + 1:
        raise KVLayoutError("seq_lens must be int32 [B] and query_start_loc int32 [B + 1]")
    if path not in (NATIVE, STRUCTURED, GENERAL, STRUCTURED_SPLIT):
        raise KVLayoutError(f"path must be 0 (native), 1 (structured), 2 (general) or 3 (structured, split launch), "
                            f"got {path}")
    bad_bounds = base_bounds is None or base_bounds.dtype != torch.int32 or not base_bounds.is_contiguous()
    if path in (STRUCTURED, STRUCTURED_SPLIT) and bad_bounds:
        raise KVLayoutError("paths 1 and 3 need base_bounds: contiguous int32 [B, 2]")
    if path == 2 and (pair_mode is None or pair_mode.dtype != torch.uint8 or pair_mode.stride(1) != 1):
        raise KVLayoutError("path 2 needs pair_mode: uint8 [B, max_pairs] with unit stride along pairs")


def _paged_attention_triton(
    q, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale, max_query_len, path, base_bounds, pair_mode,
    num_splits,
) -> torch.Tensor:  # fmt: skip
    out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    if batch == 0 or num_tokens == 0:
        return out
    group_size = num_q_heads // num_kv_heads
    block_m = choose_block_m(group_size, max_query_len)
    block_q = block_m // group_size
    num_q_blocks = triton.cdiv(max(1, max_query_len), block_q)
    if max_query_len > 1:
        # Splitting KV pays off only when one tile holds every query of a sequence, and it is kept to decode (one
        # query a sequence): a split count is a constexpr chosen from the batch size, so short queries in one tile
        # (a prefill's last few tokens beside decodes) compiled a variant per batch size and query length inside
        # somebody's step (session 25, ShareGPT on the H200: three mid-run compiles, up to 0.92 s a step). Decode
        # batches compile theirs when their graphs are captured.
        num_splits = 1
    elif num_splits <= 0:
        num_sms = current_platform().num_sms
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1], block_size, num_sms)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if path == STRUCTURED_SPLIT and num_q_blocks > 1:
        path = STRUCTURED  # the split launch merges flash-decoding partials, which only decode tiles have
    # (kernel path, first partial slot, BASE pairs per tile, KV splits, launch options); the last launch's last
    # programs merge the partials.
    if path == STRUCTURED_SPLIT:
        launches = [(3, 0, BASE_PAIRS_PER_TILE, num_splits, {}),
                    (4, num_splits, SPLIT_BASE_PAIRS_PER_TILE, num_splits * BASE_LAUNCH_SPLIT_FACTOR,
                     {**base_launch_register_cap(), **base_launch_slices(block_size)})]
    else:
        launches = [(path, 0, BASE_PAIRS_PER_TILE, num_splits, {})]
    total_splits = sum(launch[3] for launch in launches)
    partials = total_splits > 1
    layer_view = kv_cache[:, layer]  # [N, 2, H, BS, D]; data_ptr includes the layer offset
    bounds = base_bounds if path in (STRUCTURED, STRUCTURED_SPLIT) else seq_lens
    modes = pair_mode if path == GENERAL else block_tables
    # Rows a partial keeps for the merge: a decode tile's query rows, 4 of the 16 at Llama-8B's GQA group of 4; a
    # longer query (only path 3 + 4's two launches keep partials there) keeps the whole tile, one variant a tile.
    merge_rows = min(block_m, triton.next_power_of_2(group_size)) if max_query_len <= 1 else block_m
    if partials:
        splits_shape = (batch, num_kv_heads, total_splits)
        part_acc = torch.empty((*splits_shape, merge_rows, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((*splits_shape, 2, merge_rows), dtype=torch.float32, device=q.device)
        counters = split_counters(q.device, batch * num_kv_heads)
    else:
        part_acc = part_ml = counters = out  # never touched
    # Split ranges align to the tile the path reads: a BASE tile (BASE_PAIRS_PER_TILE) wherever BASE can occur, the
    # native path's own 2-pair tile otherwise, so a short context spreads over twice the programs.
    split_align = TARGET_PAIRS_PER_TILE if path == NATIVE else BASE_PAIRS_PER_TILE
    unpack_ptx = unpack_base_ptx()
    for kernel_path, split_base, base_pairs, splits, options in launches:
        grid = (batch, num_kv_heads, splits if partials else num_q_blocks)
        paged_attention_kernel[grid](
            q, out, layer_view,
            block_tables, seq_lens, query_start_loc, bounds, modes,
            part_acc, part_ml, counters,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            layer_view.stride(0), layer_view.stride(1), layer_view.stride(2), layer_view.stride(3),
            block_tables.stride(0), modes.stride(0),
            group_size, head_dim, scale * LOG2_E,
            BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=block_d,
            PAIRS=TARGET_PAIRS_PER_TILE, BASE_PAIRS=base_pairs, PATH=kernel_path, NUM_SPLITS=splits,
            INTERPRETED=triton_interpret(), PARTIALS=partials, TOTAL_SPLITS=total_splits, SPLIT_BASE=split_base,
            SPLIT_ALIGN=split_align, MERGE=partials and kernel_path != 3, MERGE_ROWS=merge_rows,
            UNPACK_PTX=unpack_ptx, **{"num_warps": NUM_WARPS, "num_stages": NUM_STAGES, **pdl_options(), **options}
        )  # fmt: skip
    return out


@torch.library.custom_op("elastiserve::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    base_bounds: torch.Tensor | None = None,
    pair_mode: torch.Tensor | None = None,
    *,
    scale: float,
    max_query_len: int,
    path: int,
    num_splits: int = 0,
) -> torch.Tensor:
    """Causal varlen attention of ``q[T, Hq, D]`` over layer ``layer`` of the paged KV cache.

    ``base_bounds`` and ``pair_mode`` are positional in the schema (custom ops allow no keyword-only tensors) but
    are best passed by keyword.

    Parameters
    ----------
    q : fp16 [T, Hq, D]; rows ``query_start_loc[b]:query_start_loc[b+1]`` belong to sequence b.
    kv_cache : fp16 [num_blocks, num_layers, 2, Hkv, block_size, D]; Hq must be a multiple of Hkv.
    block_tables : int32 [B, max_blocks]; a BASE pair lists its packed block for both logical blocks.
    seq_lens : int32 [B], KV tokens per sequence (queries included).
    query_start_loc : int32 [B + 1].
    scale : softmax scale; max_query_len : upper bound of q_len over the batch (sets the grid).
    path : 0 native, 1 structured (``base_bounds`` int32 [B, 2]), 2 general (``pair_mode`` uint8 [B, max_pairs]),
        3 structured read by two launches (TARGET ranges, BASE run) merged like KV splits (decode; prefill
        tiles take path 1).
    num_splits : KV splits for decode (0 = choose from the shapes).

    Returns fp16 [T, Hq, D]; rows past ``query_start_loc[B]`` are left unset.
    """
    _check_inputs(q, kv_cache, block_tables, seq_lens, query_start_loc, path, base_bounds, pair_mode)
    if current_platform().kernel_backend == "triton":
        return _paged_attention_triton(
            q, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale, max_query_len, path,
            base_bounds, pair_mode, num_splits,
        )  # fmt: skip
    return paged_attention_ref(
        q, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale=scale, max_query_len=max_query_len,
        path=path, base_bounds=base_bounds, pair_mode=pair_mode,
    )  # fmt: skip


@paged_attention.register_fake
def _(q, kv_cache, layer, block_tables, seq_lens, query_start_loc, base_bounds=None, pair_mode=None, *,
      scale, max_query_len, path, num_splits=0):  # fmt: skip
    return torch.empty_like(q)


# ------------------------------------------------------------------------------------ pure-torch reference


def base_pair_mask(num_pairs: int, seq: int, path: int, base_bounds, pair_mode, device) -> torch.Tensor:
    """bool [num_pairs]: which pairs of sequence ``seq`` are BASE under ``path``."""
    if path == 0 or num_pairs == 0:
        return torch.zeros(num_pairs, dtype=torch.bool, device=device)
    if path in (STRUCTURED, STRUCTURED_SPLIT):
        first, end = (int(x) for x in base_bounds[seq].tolist())
        pairs = torch.arange(num_pairs, device=device)
        return (pairs >= first) & (pairs < end)
    return pair_mode[seq, :num_pairs].to(device) != 0


def gather_kv(kv_cache, layer, block_row, seq_len: int, base_pairs: torch.Tensor):
    """Dense K, V ``[Hkv, seq_len, D]`` of one sequence as attention reads them (BASE pairs as E5M2 values)."""
    num_kv_heads, block_size, head_dim = kv_cache.shape[3:]
    num_blocks = math.ceil(seq_len / block_size)
    blocks = kv_cache[block_row[:num_blocks].long(), layer]  # [nb, 2, H, BS, D]
    if bool(base_pairs.any()):
        logical = torch.arange(num_blocks, device=blocks.device)
        base = base_pairs[logical // 2]
        half_a, half_b = base_halves(blocks)
        shape = (num_blocks, 1, 1, 1, 1)
        blocks = torch.where((base & (logical % 2 == 0)).view(shape), half_a, blocks)
        blocks = torch.where((base & (logical % 2 == 1)).view(shape), half_b, blocks)
    kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, num_kv_heads, num_blocks * block_size, head_dim)
    return kv[0, :, :seq_len], kv[1, :, :seq_len]


def paged_attention_ref(
    q, kv_cache, layer, block_tables, seq_lens, query_start_loc, *, scale, max_query_len, path,
    base_bounds=None, pair_mode=None,
) -> torch.Tensor:  # fmt: skip
    """Per-sequence dense attention in fp32 (vectorized over heads and tokens): the CPU engine's path."""
    out = torch.zeros_like(q)
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[4]
    group_size = q.shape[1] // num_kv_heads
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(lens):
        q_begin, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        num_pairs = math.ceil(seq_len / (2 * block_size))
        base = base_pair_mask(num_pairs, seq, path, base_bounds, pair_mode, kv_cache.device)
        key, value = gather_kv(kv_cache, layer, block_tables[seq], seq_len, base)
        queries = q[q_begin:q_end].float().view(q_len, num_kv_heads, group_size, -1).permute(1, 2, 0, 3)
        scores = torch.einsum("hgqd,hkd->hgqk", queries, key.float()) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        attended = torch.einsum("hgqk,hkd->hgqd", probs, value.float())
        out[q_begin:q_end] = attended.permute(2, 0, 1, 3).reshape(q_len, q.shape[1], -1).to(q.dtype)
    return out
