#!/usr/bin/env bash
# A short device call (~3 minutes) on a two-GPU host: the engine end-to-end and skinny/nested GEMM CUDA tests with
# their tracebacks on GPU 0, beside the engine decode benchmark (batch 1 / 4 / 16) on GPU 1.
source ci/gpu/bootstrap.sh
set +e
install_packages
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 140 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b --parts roofline fast_full \
    --batch 1 4 16 --kv-gib 12 --trials 5 --iters 30 --out $OUT/bench_decode.json > $OUT/bench_decode.log 2>&1
) &
BACKGROUND=$!
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest --device=cuda -p no:cacheprovider -v --tb=short \
  tests/engine/test_engine_e2e.py tests/kernels/test_skinny_gemm.py tests/kernels/test_nested_cuda_graph.py \
  tests/kernels/test_nested_gemm.py > $OUT/tests.log 2>&1
grep -E "passed|failed|FAILED" $OUT/tests.log | tail -6
wait $BACKGROUND
tail -9 $OUT/bench_decode.log
