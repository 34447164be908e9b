"""The indices of each row's k largest scores in two short launches: the first step of a head's exact top logits.

``NestedLinear.exact_top`` recomputes each token's k largest fast-mode logits from the exact weight rows, so every
decode step first finds them among 128,256 logits (Llama-3.1-8B). ``torch.topk`` does it as a radix select over the
whole row; with ``elastiserve::exact_rows`` fused, the exact-top head still cost 3.9 % of the batch-1 fast decode
step over the FP8 head on an H100 (3.180 against 3.062 ms, BENCHMARKS.md, engine, session 43), the same as with the
dozen torch ops before it (3.4 %, session 39). Here a row of up to 8,192 scores is one program that takes its k
largest by k rounds of max and mask in registers; a longer row is cut into 1,024-wide chunks, one program (one warp)
a chunk does the same, and a last program a row picks from the candidates (k a chunk: 2,016 a row at k = 16). The
union of each chunk's k largest holds the row's k largest, so the result is the same set as a full top-k, up to which
of equal scores is taken (the lowest index here).

Registered op: ``elastiserve::top_k_indices(scores, k) -> [R, k] int64`` (in no particular order);
reference: ``top_k_indices_reference`` (``torch.topk``). NaN ranks as -inf here and first in ``torch.topk``: a NaN
logit is a broken model either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.platforms import current_platform

CHUNK = 1024  # scores a first-step program
CHUNK_WARPS = 1  # one warp a chunk: its k rounds of max and min are warp shuffles, no shared memory or barrier
LAST_STEP_MAX = 8192  # candidates the last step holds in one program
LAST_STEP_WARPS = 4
MAX_K = 64  # k rounds of max + mask a program: past this a radix select (torch.topk) is the better tool


@triton.jit
def _chunk_top_kernel(scores_ptr, index_in_ptr, values_out_ptr, index_out_ptr, n, stride_sr, stride_ir, stride_or,
                      K: tl.constexpr, BLOCK: tl.constexpr, HAS_INDEX: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, chunk): the K largest of scores[row, chunk * BLOCK:][:BLOCK] to out[row, chunk * K:][:K], as
    values and as indices (the position in the row, or index_in[row, position] with HAS_INDEX, where -1 marks no
    score). A chunk with fewer than K scores writes -1 (and -inf) past them. NaN counts as -inf."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    free = offs < n
    values = tl.load(scores_ptr + row * stride_sr + offs, mask=free, other=float("-inf")).to(tl.float32)
    values = tl.where(values == values, values, float("-inf"))
    if HAS_INDEX:
        index_in = tl.load(index_in_ptr + row * stride_ir + offs, mask=free, other=-1)
        free = free & (index_in >= 0)
    out = row * stride_or + chunk * K
    for t in tl.static_range(K):
        best = tl.max(tl.where(free, values, float("-inf")), axis=0)
        pos = tl.min(tl.where(free & (values == best), offs, BLOCK * (chunk + 1)), axis=0)  # lowest of equal ones
        found = pos < BLOCK * (chunk + 1)
        if HAS_INDEX:
            index = tl.sum(tl.where(offs == pos, index_in, 0), axis=0)
        else:
            index = pos.to(tl.int64)
        tl.store(values_out_ptr + out + t, tl.where(found, best, float("-inf")))
        tl.store(index_out_ptr + out + t, tl.where(found, index, -1))
        free = free & (offs != pos)


def top_k_indices_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k] int64: each row's k largest scores' positions (``torch.topk``; ties broken either way)."""
    return scores.topk(k, dim=-1, sorted=False).indices


def _check(scores: torch.Tensor, k: int) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [R, N], got {tuple(scores.shape)}")
    if not 1 <= k <= scores.shape[1]:
        raise ValueError(f"k must be in 1..{scores.shape[1]} (the row length), got {k}")
    if not scores.dtype.is_floating_point:
        raise ValueError(f"scores must be floating point, got {scores.dtype}")


def _launch(scores: torch.Tensor, index_in: torch.Tensor | None, k: int, block: int, warps: int
            ) -> tuple[torch.Tensor, ...]:
    rows, n = scores.shape
    chunks = triton.cdiv(n, block)
    values = torch.empty((rows, chunks * k), dtype=torch.float32, device=scores.device)
    index = torch.empty((rows, chunks * k), dtype=torch.int64, device=scores.device)
    _chunk_top_kernel[(rows, chunks)](
        scores, index_in if index_in is not None else index, values, index, n, scores.stride(0),
        index_in.stride(0) if index_in is not None else 0, values.stride(0),
        K=k, BLOCK=block, HAS_INDEX=index_in is not None, num_warps=warps, **pdl_options())
    return values, index


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k] int64: the positions of each row's k largest scores, in no particular order (see the module)."""
    _check(scores, k)
    rows, n = scores.shape
    if k > MAX_K or scores.stride(1) != 1 or current_platform().kernel_backend == "reference" or rows == 0:
        return top_k_indices_reference(scores, k)
    if n <= LAST_STEP_MAX:  # one program a row is the answer
        return _launch(scores, None, k, triton.next_power_of_2(n), LAST_STEP_WARPS)[1]
    values, index = _launch(scores, None, k, CHUNK, CHUNK_WARPS)
    while values.shape[1] > LAST_STEP_MAX:  # a vocabulary past ~500 K (k = 16): another chunked step
        values, index = _launch(values, index, k, CHUNK, CHUNK_WARPS)
    return _launch(values, index, k, triton.next_power_of_2(values.shape[1]), LAST_STEP_WARPS)[1]


@torch.library.custom_op("elastiserve::top_k_indices", mutates_args=())
def top_k_indices_op(scores: torch.Tensor, k: int) -> torch.Tensor:
    return top_k_indices(scores, k)


@top_k_indices_op.register_fake
def _(scores, k):
    return scores.new_empty((scores.shape[0], k), dtype=torch.int64)
