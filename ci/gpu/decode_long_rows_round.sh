#!/usr/bin/env bash
# One device call on a one-GPU host (~4 minutes), after session 19: the decode table (roofline and fast/full at
# batches 1-32, PDL on) twice side by side: as committed (one 14,336-wide down_proj row stays weight-only,
# nested_gemm.FP8_MIN_M_QUANTIZED_LONG_INPUT 2: predicted ~-125 us a batch-1 fast step) and the session-19 routing
# (--fp8-min-rows-quantized-long 1); then the per-kernel profile at batch 1 and 4 as committed.
source ci/gpu/bootstrap.sh
set +e
start_round
for variant in "committed:" "long-rows-fp8-from-1:--fp8-min-rows-quantized-long 1"; do
  name=${variant%%:*}; extra=${variant#*:}
  timeout 150 python3 benchmarks/engine/bench_decode.py --parts roofline fast_full --batch 1 2 4 8 16 32 \
    --kv-gib 12 --iters 30 --trials 5 --out $OUT/decode-$name.json $extra > $OUT/decode-$name.log 2>&1
  echo "== $name"; sed -n "/^(a)/,/^results/p" $OUT/decode-$name.log
done
(cd benchmarks/engine && timeout $((585 - SECONDS)) python3 profile_decode_kernels.py --model llama-3.1-8b \
  --batch 1 4 --kv-gib 12 --out $OUT/decode-kernels.json > $OUT/decode-kernels.log 2>&1)
grep -v "^USDT" $OUT/decode-kernels.log | tail -30
