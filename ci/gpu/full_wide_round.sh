#!/usr/bin/env bash
# One device call on a one-GPU host (~3-4 min), written in session 34 (run in session 35): full mode's tall tiles on 256
# weight rows (probe_fp8_tiles.py --mode full --wide-only: 128x256x64 at 3 and 2 stages, 128x256x32, 64x256x64, each
# at split-K 1 and the occupancy split, by TMA) beside cuBLAS fp16, the materialized path and the table's tile, on the
# four Llama-3.1-8B linears at 48-256 rows. Offline byte count (BENCHMARKS.md, kernels, session 34): the shipped
# 64- / 128-row weight tiles move 4.0-5.4 TB/s from L2, under the 7.6-8.4 TB/s our fp8 GEMM reaches, so the latency
# of each K step bounds them; a 256-row weight tile runs 2-4x the MMAs per token tile. A tile that wins at every row
# of a class becomes
# configs.FULL_SM90_TALL's entry for it (then test_gemm_tma.py's bit test covers it). Result straight into $OUT.
source ci/gpu/bootstrap.sh
set +e
start_round
(cd benchmarks/kernels && timeout ${PROBE_LIMIT:-400} python3 probe_fp8_tiles.py --mode full --wide-only \
  --m 48 64 128 256 --shapes qkv o gate_up down --out $OUT/full-wide-tiles.json > $OUT/full-wide-tiles.log 2>&1)
tail -60 $OUT/full-wide-tiles.log
