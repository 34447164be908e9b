"""elastiserve Triton kernels as torch custom ops (namespace ``torch.ops.elastiserve``), each with a pure-torch
reference beside it. Importing this package registers every op."""

from elastiserve.kernels import (
    moe_combine,  # noqa: F401  (registers elastiserve::moe_combine)
    nested_moe,  # noqa: F401  (registers elastiserve::nested_moe)
    skinny_gemm,  # noqa: F401  (registers elastiserve::skinny_linear)
)
from elastiserve.kernels.attention import paged_attention
from elastiserve.kernels.attention_plan import (
    GENERAL,
    NATIVE,
    STRUCTURED,
    AttentionPlan,
    AttentionPlanBuffers,
    AttentionPlanConfig,
    plan_attention,
)
from elastiserve.kernels.formats import Nesting, bf16_to_fp16_checked, choose_nesting
from elastiserve.kernels.kv_ops import KVLayoutError, kv_demote, kv_promote, kv_write
from elastiserve.kernels.nested_linear import NestedLinear, NestingReport, nest_model, set_mode
from elastiserve.kernels.rms_norm import ElementwiseShapeError, fused_add_rms_norm, rms_norm
from elastiserve.kernels.rotary import rotary_embedding, rotary_kv_write
from elastiserve.kernels.silu_mul import silu_and_mul

__all__ = [
    "GENERAL",
    "NATIVE",
    "STRUCTURED",
    "AttentionPlan",
    "AttentionPlanBuffers",
    "AttentionPlanConfig",
    "ElementwiseShapeError",
    "KVLayoutError",
    "NestedLinear",
    "Nesting",
    "NestingReport",
    "bf16_to_fp16_checked",
    "choose_nesting",
    "fused_add_rms_norm",
    "kv_demote",
    "kv_promote",
    "kv_write",
    "nest_model",
    "paged_attention",
    "plan_attention",
    "rms_norm",
    "rotary_embedding",
    "rotary_kv_write",
    "set_mode",
    "silu_and_mul",
]
__version__ = "0.1.0"
