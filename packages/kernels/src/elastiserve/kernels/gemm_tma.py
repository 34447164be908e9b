"""The dense nested GEMM with its tiles fetched by the tensor memory accelerator (TMA) on sm90, for fast mode's fp8
rows (``y = (q * s_x) @ (W_upper * s_w).T``, the upper plane viewed as fp8) and for full mode (both planes decoded
to the exact fp16 weight in registers, fp16 rows).

The pointer kernel of ``nested_gemm`` fetches its tiles with ``cp.async`` and masks; here host-built tensor
descriptors let each tile arrive as one bulk copy that signals an mbarrier, and the hardware fills the rows and
columns past M, N and K with zeros, so the loop has no masks and no address arithmetic. At 16-256 rows the fp8
pointer kernel ran 1.2-1.5x slower than cuBLAS's own FP8 GEMM on the H200 (BENCHMARKS.md, kernels, session 16), and
full mode's fused tiles are bound by the issue slots the decode competes for (session 18). Full mode's table at
33-256 rows on sm90 takes this kernel (``configs.FULL_SM90_TMA``: register-A tall tiles since session 33, shared-B
tiles, ``swap_ab=False``, since session 36); fp8 rows do not (TMA tiles ran 0.93-1.05x the pointer tiles on an
H100, session 32). The epilogue is the
pointer kernel's (``gemm_epilogue``), so the two kernels store the same bits for the same accumulators, which sum the
K tiles in the same order.

Not a custom op of its own: ``nested_gemm.nested_gemm`` prepares the outputs as for the pointer kernel and calls
``launch_gemm_tma`` for a tma config, inside the ``nested_linear`` ops. Its references are theirs
(``nested_linear_ref``, ``nested_linear_fp8_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from elastiserve.kernels import configs
from elastiserve.kernels.gemm_epilogue import store_gemm_tile
from elastiserve.kernels.launch import pdl_options, wait_for_prior_grid
from elastiserve.kernels.weight_decode import decode_weight_tile, decode_weight_tile_ptx
from elastiserve.platforms import ConfigError, Vendor, current_platform
from elastiserve.platforms.env import triton_interpret

TMA_ARCHS = ("sm90",)  # bulk tensor copies: Hopper (sm90) and later; sm100 is not in the tables yet
TMA_MODES = {"full": 0, "fp8": 2}  # nested_gemm's MODE ids
ALIGN = 16  # bytes: a TMA global address and every stride but the last must be multiples of 16
TMA_MAX_BOX = 256  # elements a dimension of one bulk tensor copy's box


@triton.jit
def _gemm_tma_kernel(
    x_desc, w_desc, lower_desc, x_scale_ptr, bias_ptr, out_ptr, final_ptr, counters_ptr,
    M, N, K, k_per_split, stride_os, stride_om, stride_on, w_scale,
    MODE: tl.constexpr, NESTING: tl.constexpr, PTX_DECODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, MERGE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n  # grouped ordering, as the pointer kernel: GROUP_M row tiles sweep N together
    first_m = (pid // per_group) * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    k_start = pid_k * k_per_split
    k_end = min(k_start + k_per_split, K)
    wait_for_prior_grid(PDL)

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([pid_n * BLOCK_N, kk])  # [BLOCK_N, BLOCK_K]; past N or K: zeros
        if MODE == 0:  # both planes -> the exact fp16 weight (a zero pair decodes to +0)
            low = lower_desc.load([pid_n * BLOCK_N, kk])
            if PTX_DECODE:
                w = decode_weight_tile_ptx(w, low, MODE, NESTING)
            else:
                w = decode_weight_tile(w, low, MODE, NESTING, False)
        x = x_desc.load([pid_m * BLOCK_M, kk])  # [BLOCK_M, BLOCK_K]
        if SWAP_AB:
            acc = tl.dot(w, x.T, acc)
        else:
            acc = tl.dot(x, w.T, acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    store_gemm_tile(acc, x_scale_ptr, bias_ptr, out_ptr, final_ptr, counters_ptr, pid, pid_k, offs_m, offs_n, M, N,
                    stride_os, stride_om, stride_on, w_scale, MODE == 2, HAS_BIAS, SPLIT_K, MERGE)


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a bulk tensor copy can read ``t``: unit stride along K, rows and base 16-byte aligned."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % ALIGN == 0 and t.data_ptr() % ALIGN == 0


def check_tma(tensors: dict[str, torch.Tensor], config: configs.GemmConfig) -> None:
    """A tma config that cannot run here raises (never a silent fallback to the pointer kernel)."""
    if max(config.block_m, config.block_n, config.block_k) > TMA_MAX_BOX:
        raise ConfigError(f"tma tiles take at most {TMA_MAX_BOX} rows or columns a dimension, got {config}")
    platform = current_platform()
    if not triton_interpret() and (platform.vendor is not Vendor.NVIDIA or platform.arch not in TMA_ARCHS):
        raise ConfigError(f"tma needs an NVIDIA GPU with bulk tensor copies {TMA_ARCHS} (or the interpreter); "
                          f"platform is {platform.arch}")
    for name, t in tensors.items():
        if not tma_ready(t):
            raise ConfigError(f"tma needs the {name} 16-byte aligned with unit stride along K, got strides "
                              f"{tuple(t.stride())} at {t.data_ptr() % ALIGN} bytes past alignment")


def launch_gemm_tma(x: torch.Tensor, x_scale: torch.Tensor | None, upper: torch.Tensor, lower: torch.Tensor | None,
                    bias: torch.Tensor | None, nesting: int, mode: str, w_scale: float, config: configs.GemmConfig,
                    target: torch.Tensor, out: torch.Tensor, counters: torch.Tensor, k_per_split: int, tiles: int,
                    merge: bool) -> None:
    """fp8: ``x`` fp8 [M, K] rows, ``x_scale`` their fp32 scales [M], ``upper`` the plane viewed as its fp8 dtype;
    full: ``x`` fp16 [M, K], both uint8 planes. Writes ``target`` (``out``, or the fp32 split-K partials that the
    caller reduces unless ``merge``) as ``nested_gemm`` prepared it for the pointer kernel."""
    planes = {"rows": x, "upper plane": upper} | ({"lower plane": lower} if mode == "full" else {})
    check_tma(planes, config)
    m, k = x.shape
    n = upper.shape[0]
    split = config.split_k
    x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(upper, [config.block_n, config.block_k])
    lower_desc = TensorDescriptor.from_tensor(lower, [config.block_n, config.block_k]) if mode == "full" else w_desc
    _gemm_tma_kernel[(tiles, split)](
        x_desc, w_desc, lower_desc, x_scale if x_scale is not None else out,
        bias if bias is not None else out, target, out, counters,
        m, n, k, k_per_split, target.stride(0) if split > 1 else 0, target.stride(-2), target.stride(-1), w_scale,
        MODE=TMA_MODES[mode], NESTING=int(nesting), PTX_DECODE=config.ptx_decode,
        HAS_BIAS=bias is not None, SPLIT_K=split, SWAP_AB=config.swap_ab, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m, NUM_STAGES=config.num_stages,
        MERGE=merge, num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(),
    )
