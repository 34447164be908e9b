#!/usr/bin/env bash
# One device call on a one-GPU host (~3-4 min), written in session 34 (not yet run): full mode's tall tiles on 256
# weight rows (probe_fp8_tiles.py --mode full --wide-only: 128x256x64 at 3 and 2 stages, 128x256x32, 64x256x64, each
# at split-K 1 and the occupancy split, by TMA) beside cuBLAS fp16, the materialized path and the table's tile, on the
# four Llama-3.1-8B linears at 48-256 rows. Offline byte count (BENCHMARKS.md, kernels, session 34): the shipped
# 64- / 128-row weight tiles re-read their token tile from L2 so often that they move 4.0-5.4 TB/s into the SMs; a
# 256-row weight tile re-reads it a quarter / half as often. A tile that wins at every row of a class becomes
# configs.FULL_SM90_TALL's entry for it (then test_gemm_tma.py's bit test covers it). Result straight into $OUT.
source ci/gpu/bootstrap.sh
set +e
start_round
(cd benchmarks/kernels && timeout ${PROBE_LIMIT:-400} python3 probe_fp8_tiles.py --mode full --wide-only \
  --m 48 64 128 256 --shapes qkv o gate_up down --out $OUT/full-wide-tiles.json > $OUT/full-wide-tiles.log 2>&1)
tail -60 $OUT/full-wide-tiles.log
