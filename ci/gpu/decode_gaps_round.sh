#!/usr/bin/env bash
# One device call on a one-GPU host (~7 min; ran in session 27 at c184519): two options for fast mode's batch-2 gap
# (1.58x full, target 1.6x, ~38 us a step), both removed after it (no gain beyond run-to-run spread; BENCHMARKS.md,
# engine section, session 27). Run it from c184519, where the options and their flags exist:
# - rms_norm.WEIGHT_BEFORE_WAIT: PDL-launched norms load their weight before waiting on the previous kernel.
# - silu_mul.SINGLE_LAUNCH: the split quantizing SiLU-and-mul in one launch whose programs wait for their row's max.
# 1. Their GPU tests: the norm's bytes with and without the early load (PDL on), the single launch's bytes against
#    the two launches call after call and in a replayed graph, the fp8-row and PDL tests.
# 2. The decode table (roofline, fast/full at batches 1-32) four ways side by side: as committed, each option alone,
#    both.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(time timeout 240 nox -s test-cuda -- tests/kernels/test_silu_quant_single.py tests/kernels/test_fused_elementwise.py \
  tests/kernels/test_fp8_rows.py tests/engine/test_programmatic_launch_cuda.py) > $OUT/test-cuda-gaps.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-gaps.log | tail -8
decode_table committed
decode_table norm-early --norm-weight-early 1
decode_table silu-single --silu-quant-single-launch 1
decode_table both --norm-weight-early 1 --silu-quant-single-launch 1
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
