#!/usr/bin/env bash
# One device call on a one-GPU host (~7 min), written in session 36: full mode with the decoded weight stored to
# shared memory as wgmma's operand B and the tokens as operand A from their TMA tile (swap_ab=False), never timed
# before. Offline (sm90 SASS, Triton 3.6) its K loop is 187-197 instructions on 128x128x64 / 256x128x64 where the
# shipped register-A tall tile runs 339 (32 two-byte shared loads and 128 byte permutes to fill wgmma's A fragment).
# First the TMA tests' full-mode GPU cases (every tile, these included, gives the pointer kernel's bits and the
# reference within fp16 tolerance), then probe_fp8_tiles.py --mode full --smem-b on the four Llama-3.1-8B linears at
# 64-4,096 rows beside cuBLAS fp16, the materialized path and the table's tile. A tile that wins over the table at
# every row of a weight class and row range becomes its entry. Results straight into $OUT.
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout ${TEST_LIMIT:-150} nox -s test-cuda -- tests/kernels/test_gemm_tma.py -k "full or graph") > $OUT/test-gemm-tma-full.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-gemm-tma-full.log | tail -8
(cd benchmarks/kernels && timeout ${PROBE_LIMIT:-380} python3 probe_fp8_tiles.py --mode full --smem-b \
  --m ${ROWS:-64 128 256 1024 4096} --shapes ${SHAPES:-qkv o gate_up down} --out $OUT/full-smem-b-tiles.json \
  > $OUT/full-smem-b-tiles.log 2>&1)
grep -E "M=" $OUT/full-smem-b-tiles.log | tail -40
