#!/usr/bin/env bash
# One device call on a one-GPU host (~6 min), written in session 43: where the exact-top head's time goes, then its
# decode cost with the chunked top-k. Session 43's first H100 call measured the head with the fused exact_rows kernel
# at 3.9 % of the batch-1 fast step over the FP8 head (3.180 against 3.062 ms), no better than the torch ops before it.
# 1. The new kernel's and the head's tests on the GPU. 2. probe_exact_top.py: each step of exact_top_logits alone
# (torch.topk against top_k_indices, exact_rows at 16 / 4 / 2 / 1 picked rows a program, the scatter) at batches
# 1 / 8 / 32 and k = 16 / 64. 3. The decode table with --nest-lm-head and with --lm-head-exact-top 16, side by side.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
if [ -z "${SKIP_TESTS:-}" ]; then
  (time timeout ${TEST_LIMIT:-200} nox -s test-cuda -- tests/kernels/test_top_k.py tests/kernels/test_exact_rows.py \
    tests/kernels/test_nested_linear.py tests/kernels/test_nested_cuda_graph.py tests/engine/test_nested_lm_head.py) \
    > $OUT/test-cuda-exact-top.log 2>&1
  grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-exact-top.log | tail -8
fi
(timeout ${PROBE_LIMIT:-150} python3 benchmarks/kernels/probe_exact_top.py --out $R/probe-exact-top.json \
  > $R/probe-exact-top.log 2>&1)
tail -12 $R/probe-exact-top.log
decode_table nest-lm-head --nest-lm-head
decode_table exact-top-16 --nest-lm-head --lm-head-exact-top 16
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
