#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 minutes), session 17's second: `nox -s test-cuda` on the final tree (limit
# SUITE_LIMIT, 470 s; 7 min at ca23182), then the engine decode benchmark at batches 1-32 (fast mode's quantizing
# norms and SiLU-and-mul, and the fp8 decode row of session 17's probe) and the GEMM table at 2 and 16 rows on the
# four Llama-3.1-8B linears, in what is left of 585 s.
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout ${SUITE_LIMIT:-470} nox -s test-cuda) > $OUT/test-cuda.log 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/test-cuda.log | tail -12
(cd benchmarks/engine && timeout $((560 - SECONDS)) python3 bench_decode.py --model llama-3.1-8b \
  --parts roofline fast_full --batch 1 2 4 8 16 32 --kv-gib 12 --trials 5 --iters 30 --out $OUT/bench-decode.json \
  > $OUT/bench-decode.log 2>&1)
grep -v "^USDT" $OUT/bench-decode.log | tail -10
[ $SECONDS -lt 545 ] && (cd benchmarks/kernels && timeout $((585 - SECONDS)) python3 bench_nested_gemm.py --m 2 16 \
  --no-moe --shapes llama3.1-8b.qkv llama3.1-8b.o llama3.1-8b.gate_up llama3.1-8b.down --out $OUT/nested-gemm.json \
  > $OUT/nested-gemm.log 2>&1)
grep "M=" $OUT/nested-gemm.log
ls $OUT
