"""Decode attention launches for Nsight Compute: the native path and path 3's two all-BASE launches, each once.

bench_attention.py times the cases from CUDA graphs; this script only runs them, outside any graph, so that ncu can
profile each launch of the kernel (``--kernel-name regex:paged_attention_kernel``), in this order and ``--repeat``
times: native (path 0, one launch), then all-BASE by path 3 (its TARGET launch, which has no pair to read when every
pair is BASE, then its BASE launch, which reads and merges). The first round is where Triton compiles (on the host,
before each launch: the profiled launches are the kernels alone). Same shapes as bench_attention.py's decode table
(batch 64 x 4,096, 32 / 8 heads, dim 128, block 16):

    ncu --clock-control none --kernel-name regex:paged_attention_kernel --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis python benchmarks/kernels/ncu_attention.py
"""

from __future__ import annotations

import argparse

import torch
from bench_attention import DecodeShape, build_tables

from elastiserve.kernels.attention import paged_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=2, help="rounds of the cases (the first compiles)")
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = DecodeShape(batch=args.batch, context=args.context, layers=1)
    num_blocks, native, all_base, _, _, _ = build_tables(shape, device)
    cache = torch.randn(num_blocks, 1, 2, shape.kv_heads, shape.block_size, shape.head_dim, device=device).half()
    # Random fp16 words hold low bytes that read as E5M2 inf / NaN when BASE (session 32's run printed non-finite
    # all-BASE outputs): clearing bit 6 keeps every byte's exponent below all-ones, so both halves stay finite.
    cache = (cache.view(torch.int16) & ~0x40).view(torch.float16)
    q = torch.randn(shape.batch, shape.q_heads, shape.head_dim, device=device).half()
    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    qsl = torch.arange(shape.batch + 1, dtype=torch.int32, device=device)
    every_pair_base = torch.tensor([[0, 1 << 30]] * shape.batch, dtype=torch.int32, device=device)
    cases = {"native": (native, 0, None), "all_base_split": (all_base, 3, every_pair_base)}
    for round_index in range(args.repeat):
        for name, (table, path, bounds) in cases.items():
            out = paged_attention(q, cache, 0, table, seq_lens, qsl, base_bounds=bounds, scale=shape.head_dim**-0.5,
                                  max_query_len=1, path=path)
            torch.cuda.synchronize()
            print(f"round {round_index}: {name} (path {path}) ran, output finite: {bool(torch.isfinite(out).all())}",
                  flush=True)


if __name__ == "__main__":
    main()
