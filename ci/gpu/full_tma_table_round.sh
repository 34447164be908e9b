#!/usr/bin/env bash
# One device call on a one-GPU host (~8 min), written in session 36 after full_smem_b_round.sh: full mode's TMA table
# with the shared-B tiles on gate_up / down (33-256 rows) and o (33-64). Its CUDA tests (every table tile against the
# pointer kernel's bits, the op at each weight class and row bucket, the routing), then the whole GEMM table through
# the op (issue 3's rows, MoE included), then 40-192 rows on the eight linears. Results straight into $OUT.
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout ${TEST_LIMIT:-200} nox -s test-cuda -- tests/kernels/test_gemm_tma.py tests/kernels/test_merge_planes.py \
  tests/kernels/test_nested_gemm.py -k "full or graph or op_matches or route or takes") > $OUT/test-full-tma.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-full-tma.log | tail -8
(timeout ${TABLE_LIMIT:-240} python3 benchmarks/kernels/bench_nested_gemm.py --out $OUT/nested-gemm.json \
  > $OUT/nested-gemm.log 2>&1)
tail -30 $OUT/nested-gemm.log
(timeout ${ROWS_LIMIT:-130} python3 benchmarks/kernels/bench_nested_gemm.py --no-moe --m 40 96 128 192 \
  --out $OUT/nested-gemm-rows.json > $OUT/nested-gemm-rows.log 2>&1)
tail -12 $OUT/nested-gemm-rows.log
