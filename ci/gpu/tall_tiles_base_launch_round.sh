#!/usr/bin/env bash
# One device call on a one-GPU host (~7.5 min), session 32. Two changes measured after the session's first calls:
# 1. Full mode at 65-256 rows on TMA tall tiles (configs.FULL_SM90_TALL, off until this round: FULL_SM90_TALL_ON)
#    instead of the materialized weight: their CUDA tests (every table tile against the pointer kernel's bits, the op
#    at every weight class with the tiles on and off), then the GEMM table of the four Llama-3.1-8B linears at 64-256
#    rows with them on (ours_full is the op's route; ours_full_kernel the fused kernel's table tile). If both hold,
#    set FULL_SM90_TALL_ON = True.
# 2. Path 3's BASE launch (all-BASE 1.50x native on the H200, target 1.7x; ncu: 16 resident warps a SM, issue slots
#    42 % busy): bench_attention.py --sweep base-launch (its KV splits x1 / x2 / x4, registers capped at 96 / 80)
#    at batch 64 x 4,096 and at 4 x 1,024 in tables for 8,192 tokens, beside the native path.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(time timeout ${TEST_LIMIT:-170} nox -s test-cuda -- tests/kernels/test_gemm_tma.py tests/kernels/test_merge_planes.py \
  tests/kernels/test_attention_cuda.py tests/kernels/test_nested_gemm.py -k \
  "tma or merge or route or tall or base_launch or real_size_decode or op_matches") > $OUT/test-cuda-s32.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-s32.log | tail -12
(cd benchmarks/kernels && timeout ${GEMM_LIMIT:-110} python3 bench_nested_gemm.py --no-moe --full-tall-tiles --m 64 96 128 192 256 \
  --shapes llama3.1-8b.qkv llama3.1-8b.o llama3.1-8b.gate_up llama3.1-8b.down --out $R/gemm-tall-rows.json \
  > $R/gemm-tall-rows.log 2>&1)
grep -iE "M=|full|shape" $R/gemm-tall-rows.log | head -40
(cd benchmarks/kernels && timeout ${SWEEP_LIMIT:-170} python3 bench_attention.py --sweep base-launch \
  --out $R/attention-base-launch-64x4096.json > $R/attention-base-launch-64x4096.log 2>&1)
grep -v "^\s*$" $R/attention-base-launch-64x4096.log | tail -22
(cd benchmarks/kernels && timeout ${SHORT_LIMIT:-90} python3 bench_attention.py --sweep base-launch --batch 4 \
  --context 1024 --table-tokens 8192 --out $R/attention-base-launch-4x1024.json \
  > $R/attention-base-launch-4x1024.log 2>&1)
grep "^{" $R/attention-base-launch-4x1024.log
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
