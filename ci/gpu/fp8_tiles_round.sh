#!/usr/bin/env bash
# One device call on a one-GPU host (~7 minutes), session 16's second: the engine decode benchmark (roofline, fast vs
# full, the switch; batches 1-32) on the tree as it is, then fast mode's fp8 tile probe from 32 to 4,096 rows on the
# four Llama-3.1-8B linears (`probe_fp8_tiles.py`) with the one-pass quantizer, in what is left of 585 s.
source ci/gpu/bootstrap.sh
set +e
start_round
(cd benchmarks/engine && timeout 200 python3 bench_decode.py --model llama-3.1-8b --parts roofline fast_full switch \
  --batch 1 4 16 32 --kv-gib 12 --trials 5 --iters 30 --out $OUT/bench-decode.json > $OUT/bench-decode.log 2>&1)
grep -v "^USDT" $OUT/bench-decode.log | tail -14
(cd benchmarks/kernels && timeout $((585 - SECONDS)) python3 probe_fp8_tiles.py --out $OUT/fp8-tiles.json \
  ${PROBE_ARGS:-} > $OUT/fp8-tiles.log 2>&1)
cat $OUT/fp8-tiles.log | tail -36
ls $OUT
