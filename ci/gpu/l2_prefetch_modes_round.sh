#!/usr/bin/env bash
# One device call on a one-GPU host (~7 min), session 24: the L2 weight prefetch per GEMM mode. Session 23 timed one
# share for every mode (call 3): an eighth sped fast mode up 44-65 us a step and slowed full mode and the plain fp16
# step, so the default now prefetches in the one-plane fast modes only (weight_only, fp8). Its raw outputs did not
# survive that session, so this call times everything side by side again: the prefetch's and the PDL's CUDA tests,
# then the decode table (roofline, fast/full at 1-32) as committed, with no prefetch, with an eighth in every mode
# (session 23's), with a sixteenth in the fast modes, and with the split-K partials reduced by their own kernel.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(time timeout 120 nox -s test-cuda -- tests/kernels/test_l2_prefetch.py tests/engine/test_programmatic_launch_cuda.py) \
  > $R/test-cuda-prefetch.log 2>&1
grep -E "passed|failed|real" $R/test-cuda-prefetch.log | tail -3
decode_table committed
decode_table prefetch-off --l2-prefetch
decode_table prefetch-eighth-all --l2-prefetch full=0.125 weight_only=0.125 fp8=0.125 plain=0.125
decode_table split-k-reduce --split-k-merge 0
decode_table prefetch-sixteenth-fast --l2-prefetch weight_only=0.0625 fp8=0.0625
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
