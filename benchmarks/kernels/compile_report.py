"""Compile the GEMM and attention kernels for a GPU target on any machine (no GPU needed) and report what decides
their speed before a timing run: registers per thread (ptxas -v, hence CTAs per SM), shared memory, whether the
main loops were software-pipelined (async copies in the TTGIR), spills, and the integer instructions per weight of the
GEMM decode (PTX).

    python benchmarks/kernels/compile_report.py --out report.json          # sm90 (H100/H200)

Uses Triton's own ptxas. Argument divisibility is declared as the JIT would for 16-aligned tensors and strides; the
attention rows come twice, the second time with head_dim (and the head strides) divisible by 16 too, as the JIT
specializes head_dim 128.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from elastiserve.kernels import (
    attention,
    attention_kernels,
    configs,
    gemm_tma,
    nested_gemm,
    nested_moe,
    skinny_configs,
    skinny_gemm,
)
from elastiserve.kernels.weight_decode import PLAIN

ALIGNED_INTS = ("N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_ln", "stride_os", "stride_om",
                "stride_block", "stride_kv", "stride_head", "stride_tok", "stride_qt", "stride_ot", "stride_bt",
                "stride_pm")
DECODE_OPS = ("add", "sub", "shr", "shl", "and", "or", "xor", "prmt", "cvt", "lop3", "bfe", "selp", "mov")


def compile_kernel(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int, arch: int,
                   maxnreg: int | None = None, aligned_ints: tuple[str, ...] = ALIGNED_INTS):
    # constexpr parameters left out take their defaults, as a launch that does not pass them would
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    signature = {name: ("constexpr" if name in constexprs else types[name]) for name in fn.arg_names}
    aligned = [n for n in fn.arg_names if n not in constexprs and (types[n].startswith("*") or n in aligned_ints)]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def triton_tool(name: str) -> Path:
    """A CUDA binary that Triton's wheel carries (ptxas, nvdisasm)."""
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, bytes of spill stores) as ptxas -v reports them."""
    ptxas = triton_tool("ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", str(src), "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    spills = re.search(r"(\d+) bytes spill stores", text)
    return int(re.search(r"Used (\d+) registers", text).group(1)), int(spills.group(1)) if spills else 0


def sass_loops(kernel) -> list[dict[str, int]]:
    """SASS instruction counts (opcode with its first modifier) of each loop body of ``kernel``, in code order: the
    instructions from a label to a branch back to it (nvdisasm from Triton's own toolchain)."""
    nvdisasm = triton_tool("nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        lines = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:", line)}
    loops = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i:
            body = "\n".join(lines[labels[target.group(1)]:i + 1])
            ops = re.findall(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)?)", body)
            if len(ops) > 1:  # not the trailing self-branch
                loops.append({op: ops.count(op) for op in sorted(set(ops))})
    return loops


def facts(kernel, arch: int, threads: int) -> dict:
    regs, spills = ptxas_usage(kernel.asm["ptx"], arch)
    ops = {op: len(re.findall(rf"^\s*{op}\.", kernel.asm["ptx"], flags=re.M)) for op in DECODE_OPS}
    return {"registers": regs, "spill_store_bytes": spills, "ctas_per_sm_by_registers": 65536 // (regs * threads),
            "shared_bytes": kernel.metadata.shared,
            "async_copies": kernel.asm["ttgir"].count("async_copy_global_to_local"), "ptx_ops": ops}


def compile_gemm(mode: str, config: configs.GemmConfig, arch: int, merge: bool = False):
    """``_nested_gemm_kernel`` as the launcher specializes it for ``config`` (16-aligned sizes, no bias); ``merge``:
    the split-K partials summed in the launch (``nested_gemm.SPLIT_K_MERGE``)."""
    fn = nested_gemm._nested_gemm_kernel
    types = {"x_ptr": "*fp16", "x_scale_ptr": "*fp32", "upper_ptr": "*u8", "lower_ptr": "*u8", "bias_ptr": "*fp16",
             "out_ptr": "*fp32", "final_ptr": "*fp16", "counters_ptr": "*i32", "w_scale": "fp32"}
    if mode == "fp8":
        types.update({"x_ptr": "*fp8e4nv", "upper_ptr": "*fp8e4nv"})
    types.update({n: "i32" for n in fn.arg_names if n not in types})
    const = {"stride_xk": 1, "stride_wk": 1, "stride_lk": 1, "stride_on": 1, "MODE": nested_gemm.MODE_IDS[mode],
             "NESTING": 1, "FNUZ": False, "HAS_BIAS": False, "SPLIT_K": config.split_k, "SWAP_AB": config.swap_ab,
             "EVEN_K": True, "PTX_DECODE": config.ptx_decode, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
             "BLOCK_K": config.block_k, "GROUP_M": config.group_m, "MERGE": merge}
    return compile_kernel(fn, types, const, config.num_warps, config.num_stages, arch)


def compile_gemm_tma(mode: str, config: configs.GemmConfig, arch: int, has_bias: bool = False):
    """``gemm_tma._gemm_tma_kernel`` as ``launch_gemm_tma`` specializes it for ``config`` (16-aligned sizes): fp8
    rows, or fp16 rows and both planes (full)."""
    fn = gemm_tma._gemm_tma_kernel
    rows, plane = ("fp8e4nv", "fp8e4nv") if mode == "fp8" else ("fp16", "u8")
    types = {n: "i32" for n in fn.arg_names}
    types.update({"x_desc": f"tensordesc<{rows}[{config.block_m}, {config.block_k}]>",
                  "w_desc": f"tensordesc<{plane}[{config.block_n}, {config.block_k}]>",
                  "lower_desc": f"tensordesc<{plane}[{config.block_n}, {config.block_k}]>", "x_scale_ptr": "*fp32",
                  "bias_ptr": "*fp16", "out_ptr": "*fp32" if config.split_k > 1 else "*fp16", "final_ptr": "*fp16",
                  "counters_ptr": "*i32", "w_scale": "fp32"})
    const = {"stride_on": 1, "MODE": gemm_tma.TMA_MODES[mode], "NESTING": 1, "PTX_DECODE": config.ptx_decode,
             "HAS_BIAS": has_bias, "SPLIT_K": config.split_k, "SWAP_AB": config.swap_ab, "BLOCK_M": config.block_m,
             "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "GROUP_M": config.group_m,
             "NUM_STAGES": config.num_stages}
    return compile_kernel(fn, types, const, config.num_warps, config.num_stages, arch,
                          aligned_ints=("N", "K", "k_per_split", "stride_om", "stride_os"))


def full_tma_report(arch: int) -> list[dict]:
    """Full mode's TMA table (``configs.FULL_SM90_TMA``): per row bucket and weight class, the tile's registers,
    shared memory, CTAs a SM and its K loop's SASS (register-A tiles read the planes two bytes at a time, shared-B
    tiles 16; session 36)."""
    rows = []
    for bucket, tiles in configs.FULL_SM90_TMA.items():
        for weight_class, config in tiles.items():
            kernel = compile_gemm_tma("full", config, arch)
            k_loop = next(loop for loop in sass_loops(kernel) if any(op.startswith("HGMMA") for op in loop))
            row = {"kernel": "gemm_tma", "mode": "full", "bucket": bucket, "weight_class": weight_class,
                   "config": repr(config), "operand": "register A" if config.swap_ab else "shared B",
                   **facts(kernel, arch, 32 * config.num_warps), "k_loop_sass": sum(k_loop.values()),
                   "k_loop": k_loop}
            row["ctas_per_sm"] = min(row["ctas_per_sm_by_registers"],
                                     SM90_SHARED_PER_SM // (row["shared_bytes"] + 1024))
            rows.append(row)
            print(f"full tma {bucket:3d} {weight_class:6s} {row['operand']:10s} {config.block_m}x{config.block_n}x"
                  f"{config.block_k} w{config.num_warps} s{config.num_stages}: regs {row['registers']:3d} smem "
                  f"{row['shared_bytes'] // 1024:3d} KiB  {row['ctas_per_sm']} CTAs/SM  K loop {row['k_loop_sass']} "
                  f"SASS", flush=True)
    return rows


def merge_order(ptx: str) -> dict[str, list[int]]:
    """Offsets in the kernel body of every atomic (all, and acq_rel adds at gpu scope), barrier, global store and
    global load: what an in-launch merge's ordering (arrivals.py) is checked against."""
    body = ptx[ptx.index(".entry"):]
    at = lambda pattern: [m.start() for m in re.finditer(pattern, body)]  # noqa: E731
    return {"atomics": at(r"atom\."), "acq_rel": at(r"atom\.global\.gpu\.acq_rel\.add"), "barriers": at(r"bar\.sync"),
            "stores": at(r"st\.global"), "loads": at(r"ld\.global")}


def merge_problems(ptx: str) -> list[str]:
    """What breaks arrivals.py's ordering in a compiled in-launch merge (empty: none): one acq_rel atomic add at gpu
    scope and no other atomic, a CTA barrier between the last partial store and it, and one between it and the
    merge's first load (the atomic's result reaches every thread through shared memory)."""
    found = merge_order(ptx)
    if found["atomics"] != found["acq_rel"] or len(found["acq_rel"]) != 1:
        return [f"expected one acq_rel atomic and no other, found {found['atomics']} / {found['acq_rel']}"]
    atomic = found["acq_rel"][0]
    stores, loads = [at for at in found["stores"] if at < atomic], [at for at in found["loads"] if at > atomic]
    if not stores or not loads:
        return ["no partial store before the atomic or no merge load after it"]
    problems = []
    if not any(max(stores) < at < atomic for at in found["barriers"]):
        problems.append("no barrier between the last partial store and the atomic")
    if not any(atomic < at < min(loads) for at in found["barriers"]):
        problems.append("no barrier between the atomic and the merge's first load")
    return problems


def gemm_report(arch: int) -> list[dict]:
    rows = []
    for mode, ptx_decode in (("full", False), ("full", True), ("weight_only", False), ("weight_only", True),
                             ("fp8", False)):
        config = replace(configs.choose_config(f"sm{arch}", mode, 1, 6144, 4096, 132), ptx_decode=ptx_decode)
        kernel = compile_gemm(mode, config, arch)
        row = {"kernel": "nested_gemm", "mode": mode, "ptx_decode": ptx_decode, "M": 1, "N": 6144, "K": 4096,
               "config": repr(config), **facts(kernel, arch, 32 * config.num_warps)}
        rows.append(row)
        print(f"gemm {mode:11s} ptx_decode={ptx_decode!s:5s} regs {row['registers']:3d}  smem {row['shared_bytes']:6d}"
              f"  async copies {row['async_copies']:2d}  integer/move PTX ops {sum(row['ptx_ops'].values()):5d}",
              flush=True)
    return rows


def compile_skinny(mode: str, m_pad: int, config: skinny_configs.SkinnyConfig, arch: int, partial: bool = False,
                   even_k: bool = True):
    fn = skinny_gemm._skinny_gemm_kernel
    plane = "*fp16" if mode == "plain" else "*u8"
    types = {n: "i32" for n in fn.arg_names}
    types.update({"x_ptr": "*fp16", "w_ptr": plane, "lower_ptr": plane, "bias_ptr": "*fp16",
                  "out_ptr": "*fp32" if partial else "*fp16", "w_scale": "fp32"})
    const = {"stride_xk": 1, "stride_wk": 1, "stride_lk": 1, "stride_on": 1, "MODE": skinny_gemm.MODE_IDS[mode],
             "NESTING": 1, "HAS_BIAS": True, "PARTIAL": partial, "EVEN_K": even_k, "PTX_DECODE": config.ptx_decode,
             "DEFER": skinny_gemm.defers_reduction(config, m_pad, mode), "M_PAD": m_pad, "BLOCK_N": config.block_n,
             "BLOCK_K": config.block_k, "VEC": skinny_gemm.vector_width(mode)}
    return compile_kernel(fn, types, const, config.num_warps, config.num_stages, arch)


def loop_facts(kernel) -> dict:
    """What the (first) main loop does besides loads and FMAs: layout conversions in its TTGIR, and the barriers and
    warp shuffles of its PTX body (from the loop header to the back edge)."""
    ttgir = kernel.asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
    ptx = kernel.asm["ptx"]
    branches = [(m.start(), m.group(1)) for m in re.finditer(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ptx)]
    at, header = next((at, label) for at, label in branches if ptx.index(label + ":") < at)  # the back edge
    body = ptx[ptx.index(header + ":"):at]
    return {"loop_convert_layout": loop.count("convert_layout"), "loop_barriers": body.count("bar.sync"),
            "loop_shuffles": body.count("shfl.sync"), "loop_global_loads": body.count("ld.global")}


def skinny_report(arch: int) -> list[dict]:
    rows = []
    for mode in skinny_configs.SKINNY_MODES:
        for m_pad in (1, 2, 4, 8):
            config = skinny_configs.skinny_config(f"sm{arch}", mode, m_pad, 6144, 4096, 132)
            kernel = compile_skinny(mode, m_pad, config, arch, partial=config.split_k > 1)
            row = {"kernel": "skinny_gemm", "mode": mode, "M_PAD": m_pad, "N": 6144, "K": 4096, "config": repr(config),
                   "defer": skinny_gemm.defers_reduction(config, m_pad, mode),
                   **facts(kernel, arch, 32 * config.num_warps), **loop_facts(kernel)}
            rows.append(row)
            print(f"skinny {mode:11s} M_PAD {m_pad}  {'defer' if row['defer'] else 'step '}  regs {row['registers']:3d}"
                  f"  loop: {row['loop_convert_layout']} layout conversions, {row['loop_barriers']} barriers, "
                  f"{row['loop_shuffles']} shuffles, {row['loop_global_loads']} global loads", flush=True)
    return rows


# The grouped MoE kernel's tiles: the sm90 table's (configs._GROUPED_PREFILL_SM90) and probe_moe_configs.py's.
GROUPED_TILES = ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3),
                 (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 64, 64, 4, 3), (256, 64, 64, 8, 3),
                 (64, 64, 64, 4, 3), (128, 64, 64, 4, 3, 168), (128, 128, 64, 8, 3, 128))  # last: register caps
SM90_SHARED_PER_SM = 228 * 1024


def grouped_report(arch: int) -> list[dict]:
    """Registers, spills, shared memory and resident warps per SM of the grouped MoE kernel per tile and mode: what
    bounds overlap of one CTA's decode with another's MMA (session 9: full mode is 1.8x plain at 2,048 tokens)."""
    fn = nested_moe._nested_moe_kernel
    rows = []
    for mode in ("plain", "full", "fp8"):
        mode_id = PLAIN if mode == "plain" else nested_gemm.MODE_IDS[mode]
        plane = {"plain": "*fp16", "full": "*u8", "fp8": "*fp8e5"}[mode]
        types = {n: "i32" for n in fn.arg_names}
        types.update({"x_ptr": "*fp8e4nv" if mode == "fp8" else "*fp16", "x_scale_ptr": "*fp32", "upper_ptr": plane,
                      "lower_ptr": "*u8" if mode == "full" else plane, "out_ptr": "*fp16", "tile_expert_ptr": "*i32",
                      "tile_row_ptr": "*i32", "offsets_ptr": "*i64", "source_ptr": "*i64", "w_scale": "fp32"})
        for (bm, bn, bk, warps, stages, *cap), gather in itertools.product(GROUPED_TILES, (False, True)):
            if mode == "fp8" and bk < 64:
                continue
            const = {"stride_xk": 1, "stride_wk": 1, "stride_lk": 1, "stride_on": 1, "MODE": mode_id, "NESTING": 1,
                     "FNUZ": False, "EVEN_K": True, "PTX_DECODE": mode == "full", "GATHER": gather, "BLOCK_M": bm,
                     "BLOCK_N": bn, "BLOCK_K": bk}
            kernel = compile_kernel(fn, types, const, warps, stages, arch, maxnreg=cap[0] if cap else None)
            row = {"kernel": "nested_moe", "mode": mode, "gather": gather, "tile": [bm, bn, bk, warps, stages, *cap],
                   **facts(kernel, arch, 32 * warps)}
            ctas = min(row["ctas_per_sm_by_registers"], SM90_SHARED_PER_SM // (row["shared_bytes"] + 1024))
            row["warps_per_sm"] = ctas * warps
            rows.append(row)
            print(f"grouped {mode:5s} {bm:3d}x{bn:3d}x{bk:3d} w{warps} s{stages}"
                  f"{f' maxnreg {cap[0]}' if cap else ''}{' gather' if gather else ''}: regs {row['registers']:3d} "
                  f"spills {row['spill_store_bytes']:5d} B  smem {row['shared_bytes'] // 1024:3d} KiB  async copies "
                  f"{row['async_copies']}  {row['warps_per_sm']} warps/SM", flush=True)
    return rows


# The attention rows: (path, BASE pairs per tile, KV splits, merge in the launch). Split decode (partials) merges in
# its last program on every path but PATH 3, the first launch of the split structured path; 0 splits is the one-pass
# kernel (prefill, and decode that fills the GPU without splits).
# (path, BASE pairs per tile, KV splits, merge, warp slices)
ATTENTION_ROWS = ((0, 4, 0, False, 0), (0, 4, 4, True, 0), (0, 4, 16, True, 0), (1, 4, 4, True, 0), (1, 2, 4, True, 0),
                  (2, 4, 4, True, 0), (3, 4, 4, False, 0), (4, 4, 4, True, 0), (4, 2, 4, True, 0), (4, 2, 16, True, 0),
                  (4, 2, 16, True, 4), (4, 2, 16, True, 2))
# The JIT specializes an int argument divisible by 16 as such: head_dim 128 and the q / out head strides (128) too,
# which makes the dims mask constant over 16 lanes, so loads vectorize and the loops get async copies.
HEAD_DIM_ALIGNED = ("head_dim", "stride_qh", "stride_oh")


def compile_attention(path: int, base_pairs: int, splits: int, merge: bool, arch: int, head_dim_aligned: bool = True,
                      slices: int = 0, unpack_ptx: bool | None = None):
    """``paged_attention_kernel`` for decode at Llama-8B's GQA (16-row tiles of 4 queries x 4 q heads, 4 rows kept
    per partial), head dim 128, block size 16; ``splits`` 0 is the one-pass kernel; ``slices`` path 4's warp slices
    (``attention.BASE_LAUNCH_SLICES``, one warp each); ``unpack_ptx`` None takes ``attention.UNPACK_BASE_PTX``."""
    fn = attention_kernels.paged_attention_kernel
    types = {n: "i32" for n in fn.arg_names}
    types.update({"q_ptr": "*fp16", "out_ptr": "*fp16", "kv_ptr": "*fp16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
                  "qsl_ptr": "*i32", "bounds_ptr": "*i32", "pm_ptr": "*u8", "part_acc_ptr": "*fp32",
                  "part_ml_ptr": "*fp32", "counters_ptr": "*i32", "qk_scale": "fp32"})
    const = {"BLOCK_SIZE": 16, "BLOCK_M": 16, "BLOCK_Q": 4, "BLOCK_D": 128,
             "PAIRS": attention.TARGET_PAIRS_PER_TILE, "BASE_PAIRS": base_pairs, "PATH": path,
             "NUM_SPLITS": max(splits, 1), "INTERPRETED": False, "PARTIALS": splits > 0 or path >= 3,
             "TOTAL_SPLITS": 2 * splits if path >= 3 else max(splits, 1), "SPLIT_BASE": splits if path == 4 else 0,
             "SPLIT_ALIGN": attention.TARGET_PAIRS_PER_TILE if path == 0 else attention.BASE_PAIRS_PER_TILE,
             "MERGE": merge, "MERGE_ROWS": 4, "BASE_SLICES": slices,
             "UNPACK_PTX": attention.UNPACK_BASE_PTX if unpack_ptx is None else unpack_ptx}
    aligned_ints = ALIGNED_INTS + (HEAD_DIM_ALIGNED if head_dim_aligned else ())
    return compile_kernel(fn, types, const, slices or attention.NUM_WARPS, attention.NUM_STAGES, arch,
                          aligned_ints=aligned_ints)


def attention_report(arch: int) -> list[dict]:
    """Each row twice: head_dim unknown (any head size) and head_dim specialized like 128 (what an 8B model runs)."""
    rows = []
    for (path, base_pairs, splits, merge, slices), head_dim_aligned in itertools.product(ATTENTION_ROWS, (False, True)):
        kernel = compile_attention(path, base_pairs, splits, merge, arch, head_dim_aligned, slices)
        row = {"kernel": "paged_attention", "path": path, "base_pairs": base_pairs, "splits": splits, "merge": merge,
               "slices": slices, "head_dim_aligned": head_dim_aligned,
               **facts(kernel, arch, 32 * (slices or attention.NUM_WARPS))}
        rows.append(row)
        print(f"attention path {path} base_pairs {base_pairs} splits {splits:2d}{' merge' if merge else '      '}"
              f"{f' slices {slices}' if slices else '         '}"
              f"{' head_dim%16' if head_dim_aligned else '            '}: regs {row['registers']:3d} "
              f"({row['ctas_per_sm_by_registers']} CTAs/SM)  spills {row['spill_store_bytes']:3d}  "
              f"smem {row['shared_bytes']:6d}  async copies {row['async_copies']}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    report = {"arch": f"sm{args.arch}", "triton": triton.__version__, "gemm": gemm_report(args.arch),
              "full_tma": full_tma_report(args.arch),
              "skinny_gemm": skinny_report(args.arch), "grouped_gemm": grouped_report(args.arch),
              "attention": attention_report(args.arch)}
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
