"""Full-mode GEMM launches for Nsight Compute: the op's kernel beside cuBLAS's fp16 GEMM on the same shape, each once.

Full mode ran 0.53-0.88x of cuBLAS fp16 at 33-256 rows (BENCHMARKS.md, kernels, session 34) on tall TMA tiles
whose decoded weight is wgmma's register operand; session 36's profile found them short of resident warps.
Offline (sm90 SASS) their K loop is ~340 instructions a step for four wgmma, and neither the decode's issue slots
(~9 K warp-instructions a SM at 128 rows on qkv, ~1 us) nor the weight bytes (50 MB, ~15 us at the copy rate)
account for 32 us: this script lets ncu say what the loop waits on (stall reasons, tensor-pipe use, DRAM
throughput), against cuBLAS on the same problem. bench_nested_gemm.py times the same calls from CUDA graphs; here
each case runs outside any graph, ``--repeat`` rounds (the first compiles):

    ncu --clock-control none --kernel-name regex:"gemm|nvjet|xmma" --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis python benchmarks/kernels/ncu_full_gemm.py
"""

from __future__ import annotations

import argparse

import torch
from bench_nested_gemm import SHAPES

from elastiserve.kernels import configs, formats, nested_gemm
from elastiserve.kernels.formats import Nesting

# (linear, rows): each runs the op's tile of its row bucket (configs.FULL_SM90_TMA): shared-B tiles everywhere here
# except qkv at 128 rows (register A) since session 37; session 36's report (before the shared-B routing) has o and
# down at 64 on session 16's pointer tile and the rest on register-A tall tiles.
CASES = (("llama3.1-8b.qkv", 128), ("llama3.1-8b.gate_up", 128), ("llama3.1-8b.o", 64), ("llama3.1-8b.o", 128),
         ("llama3.1-8b.down", 64), ("llama3.1-8b.down", 128), ("llama3.1-8b.qkv", 256))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="rounds of the cases (the first compiles)")
    args = parser.parse_args()
    problems = []
    for name, rows in CASES:
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda") * 0.02).half()
        upper, lower = formats.split(w, Nesting.E4M3)
        x = torch.randn(rows, k, device="cuda").half()
        problems.append((name, rows, x, w, upper, lower))
    for round_index in range(args.repeat):
        for name, rows, x, w, upper, lower in problems:
            config = configs.choose_config("sm90", "full", rows, *w.shape, torch.cuda.get_device_properties(0)
                                           .multi_processor_count)
            full = nested_gemm.nested_linear_op(x, upper, lower, None, int(Nesting.E4M3), False)
            dense = x @ w.T
            torch.cuda.synchronize()
            err = float((full.float() - dense.float()).abs().max() / dense.float().abs().max())
            print(f"round {round_index}: {name} x {rows} rows ran (full-mode tile {config}); max error against "
                  f"cuBLAS fp16 {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
