"""Nested weights for the runner: every ``nn.Linear`` through the kernels' ``nest_model``, plus the MoE experts.

A stacked expert weight ``[E, N, K]`` gets one nesting for all of its experts, because the grouped kernel
(``elastiserve::nested_moe``) takes one nesting and one prescale exponent per call; ``formats.choose_nesting`` picks
it for the whole tensor exactly as it does for a linear. The planes replace the block's fp16 parameter and the
block's ``grouped_gemm`` hook sends them to the nested kernel. A tensor that cannot nest stays a 16-bit parameter.

Nested experts are part of their decoder layer's residual: ``layer_lower_planes`` lists them with the layer's
linears, so evicting the layer frees their lower bytes too and the restore brings them back. A nested ``lm_head``
(``EngineConfig.nest_lm_head``) is part of the last layer's, whose mode it follows (``set_layer_modes``), unless it
keeps its top logits exact (``EngineConfig.lm_head_exact_top``): it reads its lower plane in fast mode then, so the
plane stays resident.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from elastiserve.engine.models.moe import SparseMoeBlock, grouped_gemm_plain
from elastiserve.kernels import formats
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.nested_linear import NestedLinear, NestingReport, nest_model, set_mode, to_fp16_for_nesting
from elastiserve.kernels.nested_moe import nested_moe_op
from elastiserve.platforms import ConfigError

EXPERT_WEIGHTS = ("w_gate_up", "w_down")


class NestedExperts(nn.Module):
    """A stacked expert weight ``[E, N, K]`` as uint8 ``upper``/``lower`` planes, switchable full <-> fast.

    ``weight_exp`` (E4M3 only): the planes hold ``W * 2^-weight_exp`` for every expert; the kernel scales back."""

    def __init__(self, upper: torch.Tensor, lower: torch.Tensor, nesting: Nesting, weight_exp: int = 0) -> None:
        super().__init__()
        if upper.dim() != 3 or upper.shape != lower.shape or upper.dtype != torch.uint8 or lower.dtype != upper.dtype:
            raise ConfigError(f"expert planes must be uint8 [E, N, K] of one shape, got {tuple(upper.shape)} "
                              f"{upper.dtype} and {tuple(lower.shape)} {lower.dtype}")
        self.nesting = Nesting(nesting)
        if self.nesting is Nesting.NONE:
            raise ConfigError("NestedExperts needs a nesting; unnested experts stay a 16-bit parameter")
        if weight_exp and self.nesting is not Nesting.E4M3:
            raise ConfigError(f"a weight prescale needs E4M3 nesting, got {self.nesting.name}")
        self.weight_exp = weight_exp
        self.fast = False
        self.register_buffer("upper", upper)
        self.register_buffer("lower", lower)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> tuple[NestedExperts | None, str]:
        """Nest a stacked expert weight; (None, reason) when it must stay 16-bit."""
        fp16, cast_note = to_fp16_for_nesting(weight.detach())
        if fp16 is None:
            return None, cast_note
        nesting, weight_exp, reason = formats.choose_nesting(fp16)
        reason = f"{cast_note}; {reason}"
        if nesting is Nesting.NONE:
            return None, reason
        upper = torch.empty(fp16.shape, dtype=torch.uint8, device=fp16.device)
        lower = torch.empty_like(upper)
        # One expert at a time: the split's int32 temporaries then cost one expert's size, not the whole stack's.
        for expert in range(fp16.shape[0]):
            upper[expert], lower[expert] = formats.split(fp16[expert].contiguous(), nesting, weight_exp)
        return cls(upper, lower, nesting, weight_exp), reason

    @property
    def shape(self) -> torch.Size:
        """The logical ``[E, N, K]`` weight shape (``moe_experts`` reads the expert count from it)."""
        return self.upper.shape

    @property
    def is_nested(self) -> bool:
        return True

    def set_mode(self, mode: str) -> None:
        if mode not in ("full", "fast"):
            raise ConfigError(f"precision mode must be 'full' or 'fast', got {mode!r}")
        self.fast = mode == "fast"

    def bind_lower(self, plane: torch.Tensor) -> None:
        """Replace ``lower`` by an externally owned uint8 view (a slice of the layer's residual range); no copy."""
        if plane.shape != self.upper.shape or plane.dtype != torch.uint8 or plane.device != self.upper.device:
            raise ConfigError(f"lower plane must be uint8 {tuple(self.upper.shape)} on {self.upper.device}, got "
                              f"{plane.dtype} {tuple(plane.shape)} on {plane.device}")
        if not plane.is_contiguous():
            raise ConfigError("expert lower plane must be contiguous")
        self.lower = plane  # assigning a tensor to a registered buffer name keeps it a buffer

    def forward(self, x: torch.Tensor, group_offsets: torch.Tensor,
                source_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] grouped by expert (or gathered by ``source_rows`` [M] into that order), group_offsets [E + 1]
        -> [M, N]; fast mode reads ``upper`` only."""
        y = nested_moe_op(x.to(torch.float16), self.upper, self.lower, group_offsets, int(self.nesting),
                          self.fast, self.weight_exp, source_rows)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        experts, n, k = self.upper.shape
        return (f"experts={experts}, out={n}, in={k}, nesting={self.nesting.name}, weight_exp={self.weight_exp}, "
                f"fast={self.fast}")


def grouped_gemm_nested(x: torch.Tensor, weight: Any, group_offsets: torch.Tensor,
                        source_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The ``SparseMoeBlock.grouped_gemm`` hook of a nested model: nested experts run the nested kernel, a tensor that
    stayed 16-bit the plain one (``models.moe.GroupedGemm`` has the arguments)."""
    if isinstance(weight, NestedExperts):
        return weight(x, group_offsets, source_rows)
    return grouped_gemm_plain(x, weight, group_offsets, source_rows)


def nest_experts(block: SparseMoeBlock, prefix: str, report: NestingReport) -> None:
    """Replace the block's stacked fp16 expert weights by ``NestedExperts`` in place, recording each in ``report``."""
    for attr in EXPERT_WEIGHTS:
        nested, reason = NestedExperts.from_weight(getattr(block, attr))
        name = f"{prefix}.{attr}" if prefix else attr
        if nested is None:
            report.layers[name] = (Nesting.NONE, reason)
            continue
        delattr(block, attr)  # the fp16 parameter: its bytes now live in the two planes
        setattr(block, attr, nested)
        report.layers[name] = (nested.nesting, reason)
        if nested.weight_exp:
            report.weight_exps[name] = nested.weight_exp
    block.grouped_gemm = grouped_gemm_nested


def nest_weights(model: nn.Module, lm_head: bool = False, exact_top: int = 0) -> NestingReport:
    """Nest every ``nn.Linear`` but the MoE routers (and ``lm_head`` unless ``lm_head``), and every MoE block's
    stacked experts, in place.

    The router (``gate``, hidden x num_experts: 0.1 % of a Qwen3-MoE layer's bytes) stays 16-bit, as serving systems
    keep it: an FP8 router would change which experts run in fast mode, not only how precisely they run. A nested
    ``lm_head`` (``EngineConfig.nest_lm_head``) is built from its weight's values, so a tied one leaves the embedding
    its fp16 table; it runs fast with the last decoder layer, whose residual holds its lower plane. With ``exact_top``
    its ``exact_top`` largest logits a row are exact in fast mode (``NestedLinear.set_exact_top``); a head that could
    not nest is 16-bit and exact anyway.
    """
    report = nest_model(model, skip=("gate",) if lm_head else ("lm_head", "gate"))
    head = getattr(model, "lm_head", None)
    if exact_top and isinstance(head, NestedLinear) and head.is_nested:  # a NestedLinear only when lm_head
        head.set_exact_top(exact_top)
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)]
    for name, block in blocks:
        nest_experts(block, name, report)
    return report


def set_layer_modes(model: nn.Module, fast_layers: frozenset[int]) -> None:
    """Decoder layers in ``fast_layers`` run their upper planes only (linears and experts); the others run full. A
    nested ``lm_head`` follows the last layer: fast only once every layer the per-layer eviction reaches first is."""
    for index, layer in enumerate(model.decoder_layers):
        mode = "fast" if index in fast_layers else "full"
        set_mode(layer, mode)
        for module in layer.modules():
            if isinstance(module, NestedExperts):
                module.set_mode(mode)
    head = getattr(model, "lm_head", None)
    if isinstance(head, NestedLinear):
        head.set_mode("fast" if len(model.decoder_layers) - 1 in fast_layers else "full")


def layer_lower_planes(model: nn.Module) -> dict[int, list[Any]]:
    """The nested modules of each decoder layer, in module order: their lower planes form the layer's residual. A
    nested ``lm_head`` comes last in the last layer's: it runs fast exactly when that layer does."""
    planes: dict[int, list[Any]] = {}
    for index, layer in enumerate(model.decoder_layers):
        mods = [m for m in layer.modules() if isinstance(m, NestedExperts | NestedLinear) and m.is_nested]
        if mods:
            planes[index] = mods
    head = getattr(model, "lm_head", None)
    last = len(model.decoder_layers) - 1
    if isinstance(head, NestedLinear) and head.is_nested and not head.exact_top and last in planes:
        planes[last].append(head)
    return planes
