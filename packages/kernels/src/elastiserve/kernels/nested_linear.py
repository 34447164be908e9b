"""``NestedLinear``: an ``nn.Linear`` replacement holding a nested fp16 weight, switchable full <-> fast.

A layer that cannot nest (range, dtype, non-finite) keeps its 16-bit weight and runs ``F.linear`` in both modes.
``nest_model`` converts every ``nn.Linear`` of an ordinary PyTorch / transformers model in place and reports why
each unnested layer stayed 16-bit.

A nested output head may keep its largest fast-mode outputs exact (``NestedLinear.exact_top``): the ``top`` largest
logits of each row are recomputed from the exact fp16 rows of the weight (both planes of just those rows), so greedy
decoding and the probability mass near the top see the full-precision head while every other logit comes from the
upper plane alone. ``exact_top_logits`` is that step: a top-k, one ``elastiserve::exact_rows`` launch (the picked
rows of both planes merged and dotted in fp32) and a scatter, capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from elastiserve.kernels import formats
from elastiserve.kernels.exact_rows import exact_rows_op
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.fp8_activations import Fp8Rows
from elastiserve.kernels.nested_gemm import fast_mode_for, nested_linear_fp8_op, nested_linear_op
from elastiserve.platforms import ConfigError

PRECISION_MODES = ("full", "fast")


def _check_mode(mode: str) -> None:
    if mode not in PRECISION_MODES:
        raise ConfigError(f"precision mode must be one of {PRECISION_MODES}, got {mode!r}")


def to_fp16_for_nesting(weight: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """The fp16 weight to nest, or (None, reason) when the cast would change values."""
    if weight.dtype == torch.float16:
        return weight, "fp16"
    if weight.dtype == torch.bfloat16:
        cast = formats.bf16_to_fp16_checked(weight)
        if cast is None:
            return None, "bf16 not exactly representable in fp16"
        return cast, "bf16 cast to fp16 exactly"
    if weight.dtype == torch.float32:
        if not bool(torch.isfinite(weight).all()) or float(weight.abs().max()) > 65504:
            return None, "fp32 outside the fp16 range"
        return weight.to(torch.float16), "fp32 rounded to fp16"
    return None, f"dtype {weight.dtype} is not a 16/32-bit float"


class NestedLinear(nn.Module):
    """y = x @ W.T + b with W as ``upper``/``lower`` uint8 planes (or a plain 16-bit ``weight`` when unnested).

    ``weight_exp`` (E4M3 only, 0..4): the planes hold ``W * 2^-weight_exp``; the op scales the result back."""

    def __init__(self, in_features: int, out_features: int, nesting: Nesting, *, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float16,
                 weight_exp: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.nesting = Nesting(nesting)
        if weight_exp and self.nesting is not Nesting.E4M3:
            raise ConfigError(f"a weight prescale needs E4M3 nesting, got {self.nesting.name}")
        try:
            self.weight_exp = formats.check_weight_exp(weight_exp)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        self.fast = False
        self.exact_top = 0  # fast mode: the largest outputs a row recomputed exactly (exact_top_logits); 0 = none
        shape = (out_features, in_features)
        if self.nesting is Nesting.NONE:
            self.register_buffer("weight", torch.zeros(shape, dtype=dtype, device=device))
            self.upper = self.lower = None
        else:
            self.weight = None
            self.register_buffer("upper", torch.zeros(shape, dtype=torch.uint8, device=device))
            self.register_buffer("lower", torch.zeros(shape, dtype=torch.uint8, device=device))
        bias_dtype = torch.float16 if self.nesting is not Nesting.NONE else dtype
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> tuple[NestedLinear, str]:
        """Build from an ``nn.Linear``; returns the module and the reason for its nesting kind."""
        weight = linear.weight.detach()
        fp16, cast_note = to_fp16_for_nesting(weight)
        weight_exp = 0
        if fp16 is None:
            nesting, reason = Nesting.NONE, cast_note
        else:
            nesting, weight_exp, reason = formats.choose_nesting(fp16)
            reason = f"{cast_note}; {reason}"
        has_bias = linear.bias is not None
        keep_dtype = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float16
        module = cls(linear.in_features, linear.out_features, nesting, bias=has_bias, device=weight.device,
                     dtype=keep_dtype, weight_exp=weight_exp)
        if nesting is Nesting.NONE:
            module.weight = weight.to(keep_dtype).clone() if fp16 is None else fp16.to(keep_dtype).clone()
            if has_bias:
                module.bias = linear.bias.detach().to(keep_dtype).clone()
        else:
            module.upper, module.lower = formats.split(fp16.contiguous(), nesting, weight_exp)
            if has_bias:
                module.bias = linear.bias.detach().to(torch.float16).clone()
        return module, reason

    @property
    def is_nested(self) -> bool:
        return self.nesting is not Nesting.NONE

    def set_mode(self, mode: str) -> None:
        _check_mode(mode)
        self.fast = mode == "fast"

    def bind_lower(self, plane: torch.Tensor) -> None:
        """Replace ``lower`` by an externally owned uint8 view (e.g. into the SUM residual range); no copy."""
        if not self.is_nested:
            raise ConfigError("bind_lower on a layer that is not nested")
        if plane.shape != self.upper.shape or plane.dtype != torch.uint8 or plane.device != self.upper.device:
            raise ConfigError(f"lower plane must be uint8 {tuple(self.upper.shape)} on {self.upper.device}, got "
                              f"{plane.dtype} {tuple(plane.shape)} on {plane.device}")
        if plane.stride(-1) != 1:
            raise ConfigError("lower plane must be contiguous along K")
        self.lower = plane  # assigning a tensor to a registered buffer name keeps it a buffer

    def takes_fp8_rows(self, rows: int) -> bool:
        """Whether a forward over ``rows`` rows runs fast mode's fp8 GEMM, so that the norm or SiLU-and-mul before
        it may hand it ``Fp8Rows`` (quantized in that kernel) instead of fp16 rows for the GEMM to quantize."""
        return (self.is_nested and self.fast and not self.exact_top
                and fast_mode_for(rows, quantized_input=True, k=self.in_features) == "fp8")

    def set_exact_top(self, top: int) -> None:
        """Keep the ``top`` largest outputs of each row exact in fast mode (0: off); the head's 16-bit rows are
        needed for them, so the layer then takes fp16 rows only (``takes_fp8_rows`` is False)."""
        if not self.is_nested:
            raise ConfigError("exact_top needs a nested layer")
        if not 0 <= top <= self.out_features:
            raise ConfigError(f"exact_top must be in 0..{self.out_features} (the outputs), got {top}")
        self.exact_top = int(top)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if isinstance(x, Fp8Rows):
            if not self.takes_fp8_rows(x.num_rows):
                raise ConfigError(f"fp8 rows handed to a layer that does not run fp8 for them ({self.extra_repr()})")
            return nested_linear_fp8_op(x.q, x.scale, self.upper, self.lower, self.bias, int(self.nesting),
                                        self.weight_exp)
        if not self.is_nested:
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features).to(torch.float16)
        y = nested_linear_op(x2d, self.upper, self.lower, self.bias, int(self.nesting), self.fast, self.weight_exp)
        if self.fast and self.exact_top:
            y = exact_top_logits(x2d, y, self.upper, self.lower, self.bias, self.nesting, self.weight_exp,
                                 self.exact_top)
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        top = f", exact_top={self.exact_top}" if self.exact_top else ""
        return (f"in={self.in_features}, out={self.out_features}, nesting={self.nesting.name}, "
                f"weight_exp={self.weight_exp}, fast={self.fast}{top}")


def exact_top_logits(x: torch.Tensor, approx: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                     bias: torch.Tensor | None, nesting: Nesting, weight_exp: int, top: int) -> torch.Tensor:
    """``approx`` [R, N] (fast mode's ``x @ W.T + b`` for rows ``x`` [R, K]) with each row's ``top`` largest entries
    replaced by the exact weight's (``elastiserve::exact_rows``: those weight rows merged from both planes, an fp32
    dot with the row, rounded as the full-mode GEMM rounds). Ties in ``approx`` pick any ``top``; an entry outside
    them keeps its fast-mode value. Returns a new tensor."""
    top = min(int(top), approx.shape[-1])
    picked = approx.topk(top, dim=-1, sorted=False).indices  # [R, top]
    exact = exact_rows_op(x, picked, upper, lower, bias, int(nesting), int(weight_exp))
    return approx.scatter(-1, picked, exact.to(approx.dtype))


@dataclass
class NestingReport:
    """Per-layer nesting kind and the reason, by qualified module name; ``weight_exps`` lists the E4M3 layers
    nested with a power-of-two prescale (name -> exponent s: planes hold ``w * 2^-s``)."""

    layers: dict[str, tuple[Nesting, str]] = field(default_factory=dict)
    weight_exps: dict[str, int] = field(default_factory=dict)

    def count(self, nesting: Nesting) -> int:
        return sum(1 for kind, _ in self.layers.values() if kind is nesting)

    @property
    def unnested(self) -> dict[str, str]:
        return {name: reason for name, (kind, reason) in self.layers.items() if kind is Nesting.NONE}

    @property
    def prescaled(self) -> dict[str, int]:
        return {name: exp for name, exp in self.weight_exps.items() if exp}

    def summary(self) -> str:
        kinds = ", ".join(f"{kind.name}: {self.count(kind)}" for kind in Nesting)
        return f"{kinds} (E4M3 with a prescale: {len(self.prescaled)})"


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return name in skip or last in skip


def nest_model(model: nn.Module, *, skip: tuple[str, ...] = ("lm_head",)) -> NestingReport:
    """Replace every ``nn.Linear`` (except names in ``skip``) by a ``NestedLinear``, in place."""
    report = NestingReport()
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in targets:
        if _skipped(name, skip):
            report.layers[name] = (Nesting.NONE, "skipped by name (left as nn.Linear)")
            continue
        nested, reason = NestedLinear.from_linear(linear)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, nested)
        report.layers[name] = (nested.nesting, reason)
        if nested.weight_exp:
            report.weight_exps[name] = nested.weight_exp
    return report


def set_mode(model: nn.Module, mode: str) -> int:
    """Switch every ``NestedLinear`` of ``model`` to ``mode``; returns how many nested layers changed mode."""
    _check_mode(mode)
    changed = 0
    for module in model.modules():
        if isinstance(module, NestedLinear):
            changed += module.is_nested and module.fast != (mode == "fast")
            module.set_mode(mode)
    return changed
