"""Programmatic dependent launch (PDL): a kernel of a decode step starts while the one before it drains.

A batch-1 decode step of an 8B model runs ~330 kernels, most of them a few microseconds long, so the gap between
two dependent kernels (the next grid's launch and ramp-up after the last block of the previous one retires) is a
real share of the step. On sm90 a kernel launched with the PDL attribute may start once every block of the kernel
before it has executed ``griddepcontrol.launch_dependents``; it then waits in ``griddepcontrol.wait`` until that
kernel has finished and its memory is visible. Every kernel here that can be launched that way calls
``wait_for_prior_grid`` before its first global memory access, so it reads and writes exactly what it would after
an ordinary launch; only the launch overlaps. A kernel launched without the attribute (torch's, cuBLAS's) waits for
the whole previous kernel as always, and CUDA graph capture keeps the programmatic edges.

A GEMM launched that way can also ask the L2 for the first bytes of its weight rows before it waits
(``prefetch_rows_l2``): weights are never written by the kernel before, so HBM streams them while the short kernels
ahead of the GEMM (norm, rotary, attention, SiLU-and-mul) run. ``WEIGHT_PREFETCH_BYTES`` bounds that per launch, so
that a GEMM's prefetch does not evict itself from the L2 (60 MB on the H200) before its loads arrive.

Whether PDL is on is the platform's ``programmatic_launch`` (``ELASTISERVE_PDL``), resolved once: on by default on
sm90, where it cut the batch-1 decode step by 5-8 % in both modes (capability.PDL_BY_DEFAULT).
"""

from __future__ import annotations

import triton
import triton.language as tl

from elastiserve.platforms import current_platform


@triton.jit
def wait_for_prior_grid(PDL: tl.constexpr):
    """With PDL: let the next kernel launch, then wait until the previous one has finished (a no-op without)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(base_ptr, rows, mask_rows, stride_row, first_col, num_cols):
    """Ask the L2 for ``num_cols`` elements of each row from column ``first_col`` (one bulk prefetch a row, sm90's
    ``cp.async.bulk.prefetch.L2``; rows contiguous, the range 16-byte aligned and a multiple of 16 bytes); masked-off
    rows ask for row 0's range again. Only called with ``PDL``, so only on sm90."""
    row_ptrs = base_ptr + tl.where(mask_rows, rows, 0).to(tl.int64) * stride_row + first_col
    size = tl.full(rows.shape, num_cols * (base_ptr.dtype.element_ty.primitive_bitwidth // 8), tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [row_ptrs.to(tl.int64), size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_weight_rows(w_ptr, lower_ptr, rows, mask_rows, stride_w, stride_lower, first_col, num_cols,
                         BOTH_PLANES: tl.constexpr, PDL: tl.constexpr):
    """A GEMM program's prefetch before it waits: ``num_cols`` of each of its weight rows (and of the lower plane's,
    in full mode); nothing without PDL or for ``num_cols`` 0."""
    if PDL:  # noqa: SIM102  (PDL is a constexpr: the branch is compiled out without it)
        if num_cols > 0:
            prefetch_rows_l2(w_ptr, rows, mask_rows, stride_w, first_col, num_cols)
            if BOTH_PLANES:
                prefetch_rows_l2(lower_ptr, rows, mask_rows, stride_lower, first_col, num_cols)


def pdl_options() -> dict:
    """Launch keywords of a kernel that takes ``PDL: tl.constexpr`` and calls ``wait_for_prior_grid(PDL)`` first:
    empty (an ordinary launch) unless the platform launches programmatically."""
    return {"PDL": True, "launch_pdl": True} if current_platform().programmatic_launch else {}


# Bytes of weights one GEMM launch asks the L2 for before it waits, per arch (0 or absent: none). Off on sm90: 8 MiB
# made the decode step slower in both modes on the H200 (session 19, benchmarks/engine/results/
# h200-llama8b-decode-s19-call2-in-gemm-64-pdl*.json, batch 1: full 4.394 -> 4.796 ms, fast 2.943 -> 3.032 ms); smaller
# budgets were not tried.
WEIGHT_PREFETCH_BYTES: dict[str, int] = {}


def prefetch_cols(weight, k_per_split: int, splits: int) -> int:
    """Columns of each of its rows a GEMM program prefetches (a multiple of 16, at most its K range): the launch's
    ``WEIGHT_PREFETCH_BYTES`` spread over the whole weight; 0 without PDL, for a budget of 0, or for a weight whose
    rows are not contiguous and 16-byte aligned."""
    platform = current_platform()
    budget = WEIGHT_PREFETCH_BYTES.get(platform.arch, 0)
    elem = weight.element_size()
    aligned = weight.stride(1) == 1 and (weight.stride(0) * elem) % 16 == 0 and weight.data_ptr() % 16 == 0
    if not (platform.programmatic_launch and budget > 0 and aligned):
        return 0
    per_row = budget // (weight.shape[0] * splits * elem)
    return max(0, min(k_per_split, per_row) // 16 * 16)
