#!/usr/bin/env bash
# One device call on a one-GPU host (~7 min), written in session 36: full mode's Gluon GEMM (gemm_full_gluon: the
# decoded weight double-buffered in shared memory as wgmma's operand B, one wgmma kept in flight so the next K step's
# decode overlaps it), never run on a GPU. Its CUDA tests (against nested_linear_ref, both nestings, split-K, odd
# sizes), then probe_fp8_tiles.py --mode full --gluon on the four Llama-3.1-8B linears at 64-4,096 rows beside cuBLAS
# fp16, the materialized path and the table's tile; each candidate also prints its error against cuBLAS.
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout ${TEST_LIMIT:-150} nox -s test-cuda -- tests/kernels/test_gemm_full_gluon.py) \
  > $OUT/test-gemm-full-gluon.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-gemm-full-gluon.log | tail -8
(cd benchmarks/kernels && timeout ${PROBE_LIMIT:-380} python3 probe_fp8_tiles.py --mode full --gluon \
  --m ${ROWS:-64 128 256 1024 4096} --shapes ${SHAPES:-qkv o gate_up down} --out $OUT/full-gluon-tiles.json \
  > $OUT/full-gluon-tiles.log 2>&1)
grep -E "M=" $OUT/full-gluon-tiles.log | tail -60
