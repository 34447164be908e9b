#!/usr/bin/env bash
# One device call on a one-GPU host (~8 minutes), session 17's first: fast mode's fp8 tiles at decode sizes (2-16 rows,
# fp8 since session 16's FP8_MIN_M = 2; 16-row token tiles, `probe_fp8_tiles.py --m 2 4 8 16`) on the four
# Llama-3.1-8B linears, then the engine decode benchmark at batches 1-16 on the tree as it is (the baseline for any
# new decode rows: fp8 from 2 rows was never timed in the engine).
source ci/gpu/bootstrap.sh
set +e
start_round
(cd benchmarks/kernels && timeout ${PROBE_LIMIT:-330} python3 probe_fp8_tiles.py --m 2 4 8 16 \
  --out $OUT/fp8-decode-tiles.json > $OUT/fp8-decode-tiles.log 2>&1)
tail -20 $OUT/fp8-decode-tiles.log
(cd benchmarks/engine && timeout $((580 - SECONDS)) python3 bench_decode.py --model llama-3.1-8b \
  --parts roofline fast_full --batch 1 2 4 8 16 --kv-gib 12 --trials 5 --iters 30 --out $OUT/bench-decode.json \
  > $OUT/bench-decode.log 2>&1)
grep -v "^USDT" $OUT/bench-decode.log | tail -14
ls $OUT
