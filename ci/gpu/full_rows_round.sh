#!/usr/bin/env bash
# One short device call (~3 minutes), session 16's last: the new sm90 full-mode rows (17-32 rows on the 32-row PTX
# tile, materialized from 65) checked by the nested GEMM CUDA tests, then the engine decode benchmark (batches 1-32)
# and the GEMM table at 16-256 rows.
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout 60 nox -s test-cuda -- tests/kernels/test_nested_gemm.py tests/kernels/test_nested_cuda_graph.py) \
  > $OUT/test-cuda-gemm.log 2>&1
grep -E "passed|failed" $OUT/test-cuda-gemm.log | tail -2
(cd benchmarks/engine && timeout 100 python3 bench_decode.py --model llama-3.1-8b --parts roofline fast_full \
  --batch 1 16 32 64 --kv-gib 12 --trials 5 --iters 30 --out $OUT/bench-decode.json > $OUT/bench-decode.log 2>&1)
grep -v "^USDT" $OUT/bench-decode.log | tail -8
(cd benchmarks/kernels && timeout 80 python3 bench_nested_gemm.py --m 32 64 96 --no-moe --shapes llama3.1-8b.qkv \
  llama3.1-8b.o llama3.1-8b.gate_up llama3.1-8b.down --out $OUT/nested-gemm.json > $OUT/nested-gemm.log 2>&1)
grep "M=" $OUT/nested-gemm.log
