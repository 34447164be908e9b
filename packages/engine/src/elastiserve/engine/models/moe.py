"""Sparse MoE: top-k softmax routing and expert compute over stacked expert weights.

Expert weights are stacked ``w_gate_up[E, 2 * I, H]`` (gate rows first, then up) and ``w_down[E, H, I]`` so that a
grouped GEMM can take them as they are. With nested weights the runner replaces both by ``NestedExperts`` planes and
the ``grouped_gemm`` hook by one that runs ``torch.ops.elastiserve.nested_moe`` (``engine/nested_weights.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elastiserve.engine.models.layers import silu_and_mul
from elastiserve.kernels import moe_combine, nested_moe  # noqa: F401  (register elastiserve::moe_combine, ::grouped_gemm)

# grouped_gemm(x[T, K], weight[E, N, K], group_offsets[E + 1] int64, source_rows[M] int64 | None) -> [M, N]
# Row m of the product is x_sorted[m] = x[source_rows[m]] (x itself when source_rows is None: already sorted); rows
# group_offsets[e]:group_offsets[e + 1] belong to expert e and are multiplied by weight[e]^T. The kernels gather the
# rows themselves, so no sorted copy of x is written. ``weight`` is the block's stacked tensor, or whatever replaced
# it that the hook understands (nested planes).
GroupedGemm = Callable[[torch.Tensor, Any, torch.Tensor, torch.Tensor | None], torch.Tensor]


def grouped_gemm_reference(x: torch.Tensor, weight: torch.Tensor, group_offsets: torch.Tensor,
                           source_rows: torch.Tensor | None = None) -> torch.Tensor:
    x_sorted = x if source_rows is None else x[source_rows]
    out = x_sorted.new_empty(x_sorted.shape[0], weight.shape[1])
    bounds = group_offsets.tolist()
    for expert, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            out[start:end] = x_sorted[start:end] @ weight[expert].t()
    return out


def grouped_gemm_plain(x: torch.Tensor, weight: torch.Tensor, group_offsets: torch.Tensor,
                       source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The hook of unnested experts: on a GPU fp16 experts take the grouped Triton kernel (one launch, no host read,
    so the step can be captured in a CUDA graph; the loop above read the offsets back and failed capture on the
    H200); the CPU, and experts left bf16, take the loop."""
    if x.device.type != "cpu" and weight.dtype == torch.float16 and x.dtype == torch.float16:
        return torch.ops.elastiserve.grouped_gemm(x, weight, group_offsets, source_rows)
    return grouped_gemm_reference(x, weight, group_offsets, source_rows)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, keep the top k; renormalised, that equals a softmax over the k logits.

    Returns (topk_weights[T, k] fp32, topk_ids[T, k] int64).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: Any,
    w_down: Any,
    grouped_gemm: GroupedGemm = grouped_gemm_plain,
    padding_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for x[T, H]; returns [T, H] in x's dtype.

    ``w_gate_up`` / ``w_down``: stacked [E, N, K] tensors, or what ``grouped_gemm`` takes in their place (anything
    with their ``shape``). ``padding_rows``: bool [T], True for a padded step's padding rows; they go to no expert
    and come out zero. Padding rows are one token at one position, so they would all load the same top-k experts.
    The mask is built once per step (``padding_rows_of``): per layer it costs one elementwise launch (the expert-id
    fill; ``moe_combine`` zeroes the padding tokens itself); building it in every layer cost ten, 480 kernels per
    step of a 48-layer model (H200 profile, session 9)."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w_gate_up.shape[0]
    if padding_rows is not None:  # expert id E sorts last and lies past group_offsets[E]: no GEMM computes it
        topk_ids = topk_ids.masked_fill(padding_rows.unsqueeze(-1), num_experts)
    flat_ids = topk_ids.reshape(-1)
    # A stable sort keeps each expert's rows in token order, which makes the result independent of the GEMM path.
    order = torch.argsort(flat_ids, stable=True)
    source_token = order // top_k
    # scatter_add rather than bincount: bincount reads max(ids) back to the host, which breaks CUDA graph capture.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    group_offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
    group_offsets[1:] = counts[:num_experts].cumsum(dim=0)

    hidden = silu_and_mul(grouped_gemm(x, w_gate_up, group_offsets, source_token))  # rows gathered in the kernel
    expert_out = grouped_gemm(hidden, w_down, group_offsets, None)
    # Where each (token, j) row landed: the sort's inverse, so the combine reads each token's k rows by index
    # (padding rows' rows were never written and are not read: moe_combine zeroes those tokens).
    row_of = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    out = torch.ops.elastiserve.moe_combine(expert_out, row_of.view(num_tokens, top_k), topk_weights, padding_rows)
    return out.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Router + stacked experts. ``grouped_gemm`` is the hook the runner replaces with the nested kernel (and
    ``w_gate_up`` / ``w_down`` with their nested planes)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.grouped_gemm: GroupedGemm = grouped_gemm_plain

    def forward(self, x: torch.Tensor, padding_rows: torch.Tensor | None = None) -> torch.Tensor:
        topk_weights, topk_ids = route_topk(self.gate(x), self.top_k, self.renormalize)
        return moe_experts(x, topk_ids, topk_weights, self.w_gate_up, self.w_down, self.grouped_gemm, padding_rows)


def padding_rows_of(valid_tokens: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """bool [num_rows]: True from row ``valid_tokens[0]`` on (a padded step's padding); None for an unpadded step."""
    if valid_tokens is None:
        return None
    return torch.arange(num_rows, device=valid_tokens.device) >= valid_tokens
