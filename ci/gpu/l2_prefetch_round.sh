#!/usr/bin/env bash
# One device call on a one-GPU host (~5 min), session 23: the decode GEMMs prefetch their weight rows into L2 before
# waiting on the kernel before them (kernels/l2_prefetch.py; PDL only).
# 1. The prefetch's GPU test (decode GEMMs bit-equal with and without) and the engine's PDL on/off bit-equality.
# 2. The decode table (roofline, fast/full at batches 1-32) with the prefetch off, at a quarter and at half the L2
#    (session 23's default, every mode) side by side. The flag became per mode in session 24.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(time timeout 240 nox -s test-cuda -- tests/kernels/test_l2_prefetch.py tests/engine/test_programmatic_launch_cuda.py) \
  > $R/test-cuda-prefetch.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $R/test-cuda-prefetch.log | tail -8
decode_table prefetch-off --l2-prefetch
decode_table prefetch-half --l2-prefetch full=0.5 weight_only=0.5 fp8=0.5 plain=0.5
decode_table prefetch-quarter --l2-prefetch full=0.25 weight_only=0.25 fp8=0.25 plain=0.25
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
