#!/usr/bin/env bash
# One device call on a one-GPU host (~6 min), written in session 26 without a GPU, not run yet: PDL-launched norms
# that load their weight before waiting on the previous kernel (rms_norm.WEIGHT_BEFORE_WAIT, off until this runs).
# 1. The norm tests on the GPU (bytes equal with and without the early load, PDL on) and the PDL bit-equality test.
# 2. The decode table (roofline, fast/full at batches 1-32) with --norm-weight-early 0 and 1 side by side: fast mode
#    at batch 2 is ~38 us a step short of 1.6x full (session 24), and each step runs 65 norms.
# If 2 is faster in both modes and 1 passes, set WEIGHT_BEFORE_WAIT["sm90"] = True (rms_norm.py) with the figures.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(time timeout 200 nox -s test-cuda -- tests/kernels/test_fused_elementwise.py tests/kernels/test_fused_elementwise_cuda.py \
  tests/engine/test_programmatic_launch_cuda.py) > $OUT/test-cuda-norms.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-norms.log | tail -8
decode_table weight-after-wait --norm-weight-early 0
decode_table weight-before-wait --norm-weight-early 1
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
