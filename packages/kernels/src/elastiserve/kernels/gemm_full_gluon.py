"""Full mode's nested GEMM written in Gluon (Triton's explicit-layout dialect) for sm90: ``y = x @ W.T`` with W the
exact fp16 weight decoded from its two byte planes, the decoded tile double-buffered in shared memory so that the
decode of K step i + 1 runs while wgmma multiplies step i. Two kernels: ``_full_gluon_kernel`` (one warpgroup does
everything in order) and ``_full_gluon_ws_kernel`` (producer / consumer partitions: a TMA warp, a decode warpgroup,
the MMA warpgroup; written after session 36's ncu run). Both are correct on the H100 and the H200 and neither
beats the Triton tiles the op routes to (BENCHMARKS.md, kernels, sessions 36-37): no route takes them.

Why a second kernel: the Triton kernel of ``gemm_tma`` with the decoded weight as wgmma's shared operand B (session
36's ``probe_fp8_tiles.py --smem-b``) has one decoded buffer, so Triton waits for each wgmma before the next decode
(``warp_group_dot_wait pendings = 0`` in its TTGIR), and the register-A tall tiles fill wgmma's A fragment two bytes
at a time (32 LDS.U16 and 128 PRMT a K step, 339 SASS instructions; here 203 on 128x128x64 at 8 warps). Gluon states
the buffers, the mbarriers of the TMA ring and the wgmma wait depth outright:

* a ring of ``STAGES`` TMA slots, each the token tile [BM, BK] fp16 and both planes [BN, BK] u8, one mbarrier a slot;
* two decoded buffers [BN, BK] fp16 (128-byte swizzle, wgmma's operand B through a transposed view);
* per K step: wait for the slot, load both planes with 16-byte shared loads, decode four weights per PTX call (the
  sequences of ``weight_decode``), store the fp16 tile, fence, issue wgmma asynchronously, wait until one wgmma is
  left in flight (the previous one, whose slot and decoded buffer are then free), refill that slot by TMA.

A probe kernel, no table row routes to it: on an H100 (session 36, ``ci/gpu/full_gluon_round.sh``) it was correct
and slower than Triton's single-buffered shared-B tiles at 64-4,096 rows except gate_up at 64 (86.5 against 88.6
us; 189.3 against 142.3 at 256, 2596 against 2074 at 4,096): the second decoded buffer costs shared memory, so 3
stages leave one CTA a SM and 2 stages starve the TMA ring. It is the base for a producer / consumer version (a
decode warpgroup beside the MMA one), which Triton's automatic warp specialization does not build around a register
decode. Split-K writes fp32 partials that the launcher sums (one torch reduction; the pointer kernel's in-launch
merge is not ported).
Gluon has no interpreter, so the CPU tests compile it for sm90 (``tests/kernels/test_gemm_full_gluon.py``) and the
GPU tests compare it with ``nested_linear_ref``.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from elastiserve.kernels import formats
from elastiserve.kernels.weight_decode import _FULL_E4M3_PTX, _FULL_E5M2_PTX
from elastiserve.platforms import ConfigError


@gluon.jit
def _decode_full(u, low, NESTING: gl.constexpr):
    if NESTING == 1:
        return gl.inline_asm_elementwise(_FULL_E4M3_PTX, "=r,=r,r,r", [u, low], dtype=gl.float16, is_pure=True, pack=4)
    return gl.inline_asm_elementwise(_FULL_E5M2_PTX, "=r,=r,r,r", [u, low], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _tile_origin(M, N, k_per_split, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr):
    """This program's output tile and K range: (off_m, off_n, pid_k, k_start, number of K steps). Grouped ordering:
    GROUP_M token tiles sweep N together, so a weight tile is read from L2 by the group."""
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    num_m = gl.cdiv(M, BM)
    per_group = GROUP_M * gl.cdiv(N, BN)
    first_m = (pid // per_group) * GROUP_M
    group_size = gl.minimum(num_m - first_m, GROUP_M)
    off_m = (first_m + (pid % per_group) % group_size) * BM
    off_n = ((pid % per_group) // group_size) * BN
    return off_m, off_n, pid_k, pid_k * k_per_split, gl.cdiv(k_per_split, BK)


@gluon.jit
def _tma_ring(x_desc, u_desc, l_desc, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """The TMA slots: token tiles [STAGES, BM, BK] fp16 and both planes [STAGES, BN, BK] u8."""
    x_s = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], x_desc.layout)
    u_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, BK], u_desc.layout)
    l_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, BK], l_desc.layout)
    return x_s, u_s, l_s


@gluon.jit
def _store_tile(acc, bias_ptr, out_ptr, off_m, off_n, pid_k, M, N, stride_os, stride_om, w_scale,
                HAS_BIAS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, SPLIT_K: gl.constexpr,
                num_warps: gl.constexpr):
    """The accumulator times ``w_scale`` (2^weight_exp: exact, 1.0 for an unscaled layer), plus the bias, as fp16; or
    this split's fp32 partial."""
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    result = gl.convert_layout(acc, out_layout) * w_scale
    offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
    offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            result += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[None, :]
        gl.store(ptrs, result.to(gl.float16), mask=mask)
    else:
        gl.store(ptrs, result, mask=mask)


@gluon.jit
def _issue_loads(x_desc, u_desc, l_desc, x_s, u_s, l_s, ready, step, slot, off_m, off_n, k_start, num_k,
                 BK: gl.constexpr):
    do = step < num_k
    bar = ready.index(slot)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + 2 * u_desc.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=do)
    k = k_start + step * BK
    tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, x_s.index(slot), pred=do)
    tma.async_copy_global_to_shared(u_desc, [off_n, k], bar, u_s.index(slot), pred=do)
    tma.async_copy_global_to_shared(l_desc, [off_n, k], bar, l_s.index(slot), pred=do)


@gluon.jit
def _full_gluon_kernel(x_desc, u_desc, l_desc, bias_ptr, out_ptr, M, N, k_per_split, stride_os, stride_om, w_scale,
                       NESTING: gl.constexpr, HAS_BIAS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                       BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, SPLIT_K: gl.constexpr,
                       num_warps: gl.constexpr):
    off_m, off_n, pid_k, k_start, num_k = _tile_origin(M, N, k_per_split, BM, BN, BK, GROUP_M)

    x_s, u_s, l_s = _tma_ring(x_desc, u_desc, l_desc, BM, BN, BK, STAGES)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float16)
    w_s = gl.allocate_shared_memory(gl.float16, [2, BN, BK], w_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)

    # 16-byte shared loads of the planes: a row's BK bytes over BK // 16 threads
    TPR: gl.constexpr = BK // 16
    plane_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPR, TPR], [num_warps, 1], [1, 0])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)

    for i in gl.static_range(STAGES - 1):
        _issue_loads(x_desc, u_desc, l_desc, x_s, u_s, l_s, ready, i, i, off_m, off_n, k_start, num_k, BK)
    for step in range(num_k):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        u = u_s.index(slot).load(plane_layout)
        low = l_s.index(slot).load(plane_layout)
        w_buf = w_s.index(step % 2)
        w_buf.store(_decode_full(u, low, NESTING))
        fence_async_shared()
        gl.thread_barrier()  # every warp's part of the decoded tile is written before the warpgroup's wgmma reads it
        acc = warpgroup_mma(x_s.index(slot), w_buf.permute((1, 0)), acc, is_async=True)
        # the previous wgmma is done: its TMA slot (the one refilled next) and its decoded buffer are free
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=[acc, x_s.index(slot), w_buf])
        _issue_loads(x_desc, u_desc, l_desc, x_s, u_s, l_s, ready, step + STAGES - 1, (step + STAGES - 1) % STAGES,
                     off_m, off_n, k_start, num_k, BK)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    _store_tile(acc, bias_ptr, out_ptr, off_m, off_n, pid_k, M, N, stride_os, stride_om, w_scale, HAS_BIAS, BM, BN,
                SPLIT_K, num_warps)


# ---- producer / consumer version: a TMA warp, a decode warpgroup, an MMA warpgroup (the default partition) -------
# Why: the ncu profile of session 36 found full mode's K loops short of resident warps that are not busy with the
# decode (1-3 warps a scheduler, 17-42 % of the issue slots on decode and its shared traffic), where cuBLAS's loads
# and MMAs run with few instructions. Here the decode runs in its own warps, ahead of the MMA by up to WBUF steps, and
# the MMA warpgroup only waits and issues wgmma. Barriers (each one arrival, by one thread of its partition):
#   ready[s]   TMA bytes of slot s landed (expect + copies by the loader)      waited by decoder and MMA
#   planes[s]  the decoder has read slot s's planes into registers           waited by the loader
#   tokens[s]  the MMA warpgroup's wgmma on slot s's token tile completed      waited by the loader
#   decoded[b] the decoder stored step i's fp16 tile into buffer b             waited by the MMA warpgroup
#   spent[b]   the wgmma that read buffer b completed                          waited by the decoder
# A producer waits for parity (phase ^ 1): a fresh mbarrier counts as having completed the phase before its first.


@gluon.jit
def _ws_loader(x_desc, u_desc, l_desc, x_s, u_s, l_s, ready, planes, tokens, off_m, off_n, k_start, num_k,
               BK: gl.constexpr, STAGES: gl.constexpr):
    for step in range(num_k):
        slot = step % STAGES
        phase = (step // STAGES) & 1
        mbarrier.wait(planes.index(slot), phase ^ 1)
        mbarrier.wait(tokens.index(slot), phase ^ 1)
        _issue_loads(x_desc, u_desc, l_desc, x_s, u_s, l_s, ready, step, slot, off_m, off_n, k_start, num_k, BK)


@gluon.jit
def _ws_decoder(u_s, l_s, w_s, ready, planes, decoded, spent, num_k, NESTING: gl.constexpr, BK: gl.constexpr,
                STAGES: gl.constexpr, WBUF: gl.constexpr):
    TPR: gl.constexpr = BK // 16
    plane_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPR, TPR], [gl.num_warps(), 1], [1, 0])
    for step in range(num_k):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        u = u_s.index(slot).load(plane_layout)
        low = l_s.index(slot).load(plane_layout)
        gl.thread_barrier()  # every warp of the partition holds its bytes before the slot is handed back
        mbarrier.arrive(planes.index(slot))
        buf = step % WBUF
        mbarrier.wait(spent.index(buf), ((step // WBUF) & 1) ^ 1)
        w_s.index(buf).store(_decode_full(u, low, NESTING))
        fence_async_shared()
        gl.thread_barrier()  # the whole tile is stored (and fenced for the async proxy) before wgmma may read it
        mbarrier.arrive(decoded.index(buf))


@gluon.jit
def _ws_mma(x_s, w_s, ready, tokens, decoded, spent, num_k, BM: gl.constexpr, BN: gl.constexpr,
            STAGES: gl.constexpr, WBUF: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    for step in range(num_k):
        slot = step % STAGES
        buf = step % WBUF
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        mbarrier.wait(decoded.index(buf), (step // WBUF) & 1)
        acc = warpgroup_mma(x_s.index(slot), w_s.index(buf).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        # wgmma step - 1 completed: its token slot and decoded buffer go back to their producers
        prev = step + STAGES - 1
        prev_buf = step + WBUF - 1
        mbarrier.arrive(tokens.index(prev % STAGES), pred=step > 0)
        mbarrier.arrive(spent.index(prev_buf % WBUF), pred=step > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    return (acc,)


@gluon.jit
def _full_gluon_ws_kernel(x_desc, u_desc, l_desc, bias_ptr, out_ptr, M, N, k_per_split, stride_os, stride_om,
                          w_scale, NESTING: gl.constexpr, HAS_BIAS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                          BK: gl.constexpr, STAGES: gl.constexpr, WBUF: gl.constexpr, GROUP_M: gl.constexpr,
                          SPLIT_K: gl.constexpr, DECODE_WARPS: gl.constexpr, DECODE_REGS: gl.constexpr,
                          num_warps: gl.constexpr):
    off_m, off_n, pid_k, k_start, num_k = _tile_origin(M, N, k_per_split, BM, BN, BK, GROUP_M)

    x_s, u_s, l_s = _tma_ring(x_desc, u_desc, l_desc, BM, BN, BK, STAGES)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float16)
    w_s = gl.allocate_shared_memory(gl.float16, [WBUF, BN, BK], w_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    planes = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    tokens = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    decoded = gl.allocate_shared_memory(gl.int64, [WBUF, 1], mbarrier.MBarrierLayout())
    spent = gl.allocate_shared_memory(gl.int64, [WBUF, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(planes.index(s), count=1)
        mbarrier.init(tokens.index(s), count=1)
    for b in gl.static_range(WBUF):
        mbarrier.init(decoded.index(b), count=1)
        mbarrier.init(spent.index(b), count=1)

    (acc,) = gl.warp_specialize([
        (_ws_mma, (x_s, w_s, ready, tokens, decoded, spent, num_k, BM, BN, STAGES, WBUF)),
        (_ws_decoder, (u_s, l_s, w_s, ready, planes, decoded, spent, num_k, NESTING, BK, STAGES, WBUF)),
        (_ws_loader, (x_desc, u_desc, l_desc, x_s, u_s, l_s, ready, planes, tokens, off_m, off_n, k_start, num_k, BK,
                      STAGES)),
    ], [DECODE_WARPS, 1], [DECODE_REGS, 24])

    _store_tile(acc, bias_ptr, out_ptr, off_m, off_n, pid_k, M, N, stride_os, stride_om, w_scale, HAS_BIAS, BM, BN,
                SPLIT_K, num_warps)


def launch_full_gluon(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, nesting: int, block_m: int,
                      block_n: int, block_k: int = 64, num_stages: int = 3, num_warps: int = 4, split_k: int = 1,
                      group_m: int = 8, bias: torch.Tensor | None = None, weight_exp: int = 0,
                      warp_specialized: bool = False, decode_regs: int = 168) -> torch.Tensor:
    """fp16 ``x`` [M, K] times the weight the uint8 planes [N, K] nest (``nesting`` 1 = E4M3, 2 = E5M2; planes of
    ``w * 2^-weight_exp``), plus ``bias``: fp16 [M, N]. Tiles: wgmma takes 64 token rows a warpgroup (``block_m`` a
    multiple of 16 * num_warps) and ``block_n`` weight rows up to 256. ``warp_specialized``: the producer / consumer
    kernel, ``num_warps`` MMA warps beside a 4-warp decode partition holding ``decode_regs`` registers a thread and
    a TMA warp."""
    if x.dtype != torch.float16 or upper.dtype != torch.uint8 or lower.dtype != torch.uint8:
        raise ConfigError(f"full-mode Gluon GEMM takes fp16 rows and uint8 planes, got {x.dtype}, {upper.dtype}, "
                          f"{lower.dtype}")
    if nesting not in (1, 2):
        raise ConfigError(f"nesting must be 1 (E4M3) or 2 (E5M2), got {nesting}")
    if block_m % (16 * num_warps) or block_n > 256 or block_n % 16 or block_k not in (32, 64, 128):
        raise ConfigError(f"unsupported tile {block_m}x{block_n}x{block_k} at {num_warps} warps")
    if warp_specialized and not (24 <= decode_regs <= 256 and decode_regs % 8 == 0):
        raise ConfigError(f"decode_regs must be a multiple of 8 in 24-256 (setmaxnreg), got {decode_regs}")
    m, k = x.shape
    n = upper.shape[0]
    k_per_split = -(-k // (split_k * block_k)) * block_k
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k],
                                          gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.float16))
    plane_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.uint8)
    u_desc = TensorDescriptor.from_tensor(upper, [block_n, block_k], plane_layout)
    l_desc = TensorDescriptor.from_tensor(lower, [block_n, block_k], plane_layout)
    if split_k == 1:
        out = torch.empty(m, n, dtype=torch.float16, device=x.device)
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (-(-m // block_m) * -(-n // block_n), split_k)
    w_scale = 2.0 ** formats.check_weight_exp(weight_exp)
    args = (x_desc, u_desc, l_desc, bias if bias is not None else out, out, m, n, k_per_split,
            out.stride(0) if split_k > 1 else 0, out.stride(-2), w_scale)
    shape = dict(NESTING=nesting, HAS_BIAS=bias is not None, BM=block_m, BN=block_n, BK=block_k, STAGES=num_stages,
                 GROUP_M=group_m, SPLIT_K=split_k, num_warps=num_warps)
    if warp_specialized:
        _full_gluon_ws_kernel[grid](*args, **shape, WBUF=2, DECODE_WARPS=4, DECODE_REGS=decode_regs)
    else:
        _full_gluon_kernel[grid](*args, **shape)
    if split_k == 1:
        return out
    total = out.sum(0)  # the partials in split order, one reduction (no in-launch merge yet)
    return (total if bias is None else total + bias.float()).half()
