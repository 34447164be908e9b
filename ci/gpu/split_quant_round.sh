#!/usr/bin/env bash
# One short device call on a one-GPU host (~4 min), session 20: the quantizing SiLU-and-mul split over programs at
# few rows (silu_mul.SPLIT_QUANT_MAX_ROWS) against one program a row (--split-quant-max-rows 0), decode fast/full at
# batches 1-32 side by side; then the fp8-row and PDL GPU tests.
source ci/gpu/bootstrap.sh
set +e
start_round
for v in "split:" "one-program:--split-quant-max-rows 0"; do
  n=${v%%:*}; e=${v#*:}
  timeout 90 python3 benchmarks/engine/bench_decode.py --parts fast_full --batch 1 2 4 8 16 32 --kv-gib 12 \
    --iters 30 --trials 5 --out $OUT/decode-$n.json $e > $OUT/decode-$n.log 2>&1
  echo "== $n"; sed -n "/^(b)/,/^results/p" $OUT/decode-$n.log
done
(time timeout $((${LIMIT:-250} - SECONDS)) nox -s test-cuda -- tests/kernels/test_fp8_rows.py \
  tests/engine/test_programmatic_launch_cuda.py tests/engine/test_engine_e2e.py) > $OUT/test-cuda.log 2>&1
grep -E "passed|failed|FAILED|real" $OUT/test-cuda.log | tail -6
