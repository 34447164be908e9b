"""Each kind of linear and of MoE block, run alone at every row count where ``kernels.warm_rows`` finds a new kernel
variant, so that the GEMM variants between the M buckets' tops compile before serving (``ModelRunner.warm_up``).

The model-level warm-up forwards (``warmup.warm_up_shapes``) meet the buckets' tops only. Between them the dense
GEMM's fp8 table rows (32, 128, 512) and its split-K (per row tile) change; the first nested engine of a process
compiled 17 such variants inside its ShareGPT loop on the H200 (session 25, 21 s of a 63 s loop). A MoE block's
grouped GEMM picks its tile from the rows per expert, tokens x top-k / experts, so its variants change at other
token counts again, and the quantizer before its fp8 GEMMs at others still (``warm_rows.grouped_launch_key``).

Linears and blocks are picked one per kind: what decides a compile is the class, shapes, nesting (a constexpr of
the kernels) and, for blocks, the expert count and top-k; weights, prescale exponents and layer index do not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from elastiserve.engine.models.moe import SparseMoeBlock
from elastiserve.engine.nested_weights import EXPERT_WEIGHTS, NestedExperts
from elastiserve.kernels.fp8_activations import Fp8Rows, platform_fnuz, quantize_per_token
from elastiserve.kernels.nested_linear import NestedLinear
from elastiserve.kernels.warm_rows import Shape


def distinct_linears(model: nn.Module) -> list[nn.Linear | NestedLinear]:
    """One linear of each kind the model launches GEMMs for: (class, out, in, nesting, bias). Plain ``nn.Linear``
    (lm_head; every linear of an unnested model) and ``NestedLinear`` alike; MoE experts are not linears."""
    kinds: dict[tuple, nn.Module] = {}
    for module in model.modules():
        if isinstance(module, NestedLinear | nn.Linear):
            nesting = getattr(module, "nesting", None)
            key = (type(module), module.out_features, module.in_features, nesting, module.bias is not None)
            kinds.setdefault(key, module)
    return list(kinds.values())


def linear_shapes(linears: list[nn.Module]) -> list[Shape]:
    """The (N, K) of each linear: ``warm_rows.launch_key``'s shape arguments."""
    return [(linear.out_features, linear.in_features) for linear in linears]


def _expert_kind(weight: Any) -> tuple:
    if isinstance(weight, NestedExperts):
        return NestedExperts, tuple(weight.shape), weight.nesting
    return type(weight), tuple(weight.shape), weight.dtype


def distinct_moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """One MoE block of each kind: its two expert tensors' (class, [E, N, K], nesting or dtype) and its top-k."""
    kinds: dict[tuple, SparseMoeBlock] = {}
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            key = (*(_expert_kind(getattr(module, attr)) for attr in EXPERT_WEIGHTS), module.top_k)
            kinds.setdefault(key, module)
    return list(kinds.values())


def expert_shapes(block: SparseMoeBlock) -> list[Shape]:
    """``warm_rows.grouped_launch_key``'s shape arguments for the block's two grouped GEMMs: (N, K, experts, top-k,
    gathers); the first gathers its rows from the unsorted tokens, the second reads them in expert order."""
    shapes = []
    for attr, gathers in zip(EXPERT_WEIGHTS, (True, False), strict=True):
        num_experts, n, k = getattr(block, attr).shape
        shapes.append((n, k, num_experts, block.top_k, gathers))
    return shapes


@torch.inference_mode()
def warm_up_linears(linears: list[nn.Module], rows: list[int], device: torch.device) -> None:
    """Run each linear at each row count, in whatever mode its layer is in now, on fp16 rows and, where it would run
    fp8 on them, on ``Fp8Rows`` as a quantizing norm or SiLU-and-mul hands them over: every GEMM variant those row
    counts launch compiles here (``kernels.warm_rows`` picks the rows)."""
    if not rows:
        return
    for linear in linears:
        x = torch.zeros((max(rows), linear.in_features), dtype=torch.float16, device=device)
        for m in rows:
            linear(x[:m])
            if getattr(linear, "takes_fp8_rows", None) is not None and linear.takes_fp8_rows(m):
                linear(Fp8Rows(*quantize_per_token(x[:m], platform_fnuz())))


@torch.inference_mode()
def warm_up_moe_block(block: SparseMoeBlock, tokens: list[int], device: torch.device) -> None:
    """Run the block (router, both grouped GEMMs, SiLU-and-mul, combine) on each token count, in whatever mode its
    layer is in now. Zero rows route every token to the same experts; the kernels' variants do not care, because the
    grouped GEMM's tile follows the static rows-per-expert estimate, not the routing (``nested_moe``)."""
    if not tokens:
        return
    x = torch.zeros((max(tokens), block.gate.in_features), dtype=block.gate.weight.dtype, device=device)
    for count in tokens:
        block(x[:count])
