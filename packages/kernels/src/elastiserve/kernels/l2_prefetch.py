"""Weight prefetch into L2 while the previous kernel of the step finishes (programmatic dependent launch only).

With PDL (``launch.py``) a GEMM's programs are resident and parked in ``griddepcontrol.wait`` while the kernel before
it (a norm, the attention, SiLU-and-mul) still runs. At decode sizes those kernels read little and take 1-6 us each,
so the HBM idles between two GEMMs while the next GEMM's weights, which no kernel of the step writes, wait to be
read. Here each program, before it waits, asks the L2 for the start of its own weight slab with one
``cp.async.bulk.prefetch.L2`` per thread (sm90+, a hint: it reads nothing into registers and cannot fault the
kernel's result); its loop then finds those lines in L2. What every kernel reads after the wait is unchanged.

``L2_PREFETCH_SHARE`` caps the bytes one launch asks for, per arch and GEMM mode, as a share of the GPU's L2 (60 MB
on the H200), so prefetched lines are not evicted by each other before the loop reaches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from elastiserve.platforms import Vendor, current_platform
from elastiserve.platforms.env import triton_interpret

# Share of the L2 one GEMM launch may prefetch, per arch and mode (nested_gemm / skinny_gemm mode names); absent or
# 0: no prefetch. Session 23 timed one share for every mode (Llama-3.1-8B decode step, H200, call 3): at an eighth
# fast mode was 44-65 us a step faster at batches 1-32 (2.590 -> 2.546 ms at batch 1), while full mode (both planes)
# and the plain fp16 step were ~50 us slower at batch 1 and full up to 300 us slower above it; half the L2 slowed
# every mode (fast 2.685 ms at batch 1). So only the one-plane fast modes prefetch.
L2_PREFETCH_SHARE: dict[str, dict[str, float]] = {"sm90": {"weight_only": 0.125, "fp8": 0.125}}
_ALIGN = 16  # cp.async.bulk: 16-byte aligned address, size a multiple of 16

# $1 address, $2 bytes (0: this thread has no piece).
_PREFETCH_PTX = tl.constexpr("""{
.reg .pred p;
setp.ne.u32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")
# Smallest piece one thread asks for: each bulk prefetch is one operation of the SM's copy engine, and pieces of
# 16-64 bytes (one per thread over a 2-8 KB row) made the batch-1 fp16 step 12 % slower (session 23, call 2).
MIN_PIECE = 1024


@triton.jit
def prefetch_rows_l2(base_ptr, first_row, N, stride_n, k_start_bytes, BLOCK_N: tl.constexpr, ROW_BYTES: tl.constexpr,
                     CHUNKS: tl.constexpr, THREADS: tl.constexpr):
    """Prefetch ROW_BYTES of each of the BLOCK_N rows from ``first_row`` (clamped to N - 1: valid memory), from byte
    ``k_start_bytes`` of the row, as CHUNKS pieces a row. Element i of a [max(THREADS, BLOCK_N * CHUNKS)] tensor (one
    per thread of the program's default layout) is piece i // BLOCK_N of row i % BLOCK_N; elements past
    BLOCK_N * CHUNKS ask for nothing, so no two threads ask for the same bytes."""
    PIECE: tl.constexpr = ROW_BYTES // CHUNKS
    PIECES: tl.constexpr = BLOCK_N * CHUNKS
    SLOTS: tl.constexpr = THREADS if THREADS > PIECES else PIECES
    slot = tl.arange(0, SLOTS)
    row = tl.minimum(first_row + slot % BLOCK_N, N - 1).to(tl.int64)
    addr = (base_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + row * stride_n + k_start_bytes
            + ((slot // BLOCK_N) % CHUNKS) * PIECE)
    size = tl.where(slot < PIECES, PIECE, 0)
    tl.inline_asm_elementwise(_PREFETCH_PTX, "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_plan(tensor, mode: str, rows_per_program: int, programs: int, k_per_split: int, splits: int,
                  num_warps: int, lower=None) -> dict:
    """The kernel keywords ``PREFETCH_ROW_BYTES``, ``PREFETCH_CHUNKS`` and ``PREFETCH_THREADS`` for
    ``prefetch_rows_l2`` on a row-major [N, K] ``tensor`` read in GEMM ``mode`` by ``programs`` programs of
    ``rows_per_program`` rows and ``k_per_split`` columns each (``splits`` K ranges; the last may be short, and a
    prefetch stays inside its row): ROW_BYTES 0 (off) unless this platform launches programmatically on an arch with
    a budget for ``mode`` and the rows allow aligned bulk copies. ``lower``: the second plane, prefetched alike in
    full mode only (it halves each plane's share of the budget; the other modes never read it, and an evicted lower
    plane holds KV). ROW_BYTES is a power of two, so a shape compiles one variant whatever its grid."""
    off = {"PREFETCH_ROW_BYTES": 0, "PREFETCH_CHUNKS": 1, "PREFETCH_THREADS": 32}
    platform = current_platform()
    budget = int(L2_PREFETCH_SHARE.get(platform.arch, {}).get(mode, 0.0) * platform.l2_bytes)
    size = tensor.element_size()
    planes = [tensor, lower] if mode == "full" and lower is not None else [tensor]
    if (not budget or not platform.programmatic_launch or platform.vendor is not Vendor.NVIDIA or triton_interpret()
            or (k_per_split * size) % _ALIGN or not all(_bulk_aligned(plane) for plane in planes)):
        return off
    last_range = tensor.shape[1] - (splits - 1) * k_per_split
    per_row = min(min(k_per_split, last_range) * size, budget // (programs * rows_per_program * len(planes)))
    if per_row < _ALIGN:
        return off
    row_bytes = 1 << (per_row.bit_length() - 1)
    threads = num_warps * 32
    chunks = max(1, min(threads // rows_per_program, row_bytes // MIN_PIECE))  # pieces >= MIN_PIECE or whole rows
    return {"PREFETCH_ROW_BYTES": row_bytes, "PREFETCH_CHUNKS": 1 << (chunks.bit_length() - 1),
            "PREFETCH_THREADS": threads}


def _bulk_aligned(plane) -> bool:
    """Row-major, with every row starting on a 16-byte boundary."""
    return (plane.stride(-1) == 1 and plane.data_ptr() % _ALIGN == 0
            and plane.stride(0) * plane.element_size() % _ALIGN == 0)
