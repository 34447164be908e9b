#!/usr/bin/env bash
# One device call on a one-GPU host (~4 min), written in session 36 (run in session 37): full mode's producer / consumer
# Gluon GEMM (gemm_full_gluon._full_gluon_ws_kernel: a TMA warp, a 4-warp decode partition, the MMA warpgroup; five
# mbarrier rings), written after that session's ncu run found full mode's K loops short of warps free of decode work
# (1-3 warps a scheduler). Its CUDA tests first (a pipeline bug hangs rather than fails: the test's thread timeout
# ends the process after 120 s), then probe_fp8_tiles.py --mode full --gluon-ws at 64-4,096 rows beside cuBLAS fp16,
# the materialized path and the table. A tile that beats the table at every row of a bucket and class is a candidate
# for configs.FULL_SM90_TMA (the op would need it routed: nested_gemm has no Gluon path yet).
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout ${TEST_LIMIT:-200} nox -s test-cuda -- tests/kernels/test_gemm_full_gluon.py) \
  > $OUT/test-gemm-full-gluon-ws.log 2>&1
grep -E "passed|failed|FAILED|Error|Timeout|real" $OUT/test-gemm-full-gluon-ws.log | tail -8
(cd benchmarks/kernels && timeout ${PROBE_LIMIT:-300} python3 probe_fp8_tiles.py --mode full --gluon-ws \
  --m ${ROWS:-64 128 256 1024 4096} --shapes ${SHAPES:-qkv o gate_up down} --out $OUT/full-gluon-ws-tiles.json \
  > $OUT/full-gluon-ws-tiles.log 2>&1)
grep -E "M=" $OUT/full-gluon-ws-tiles.log | tail -60
