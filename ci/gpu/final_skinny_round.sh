#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 min), session 22's last: the decode table (roofline, fast/full at batches
# 1-32) as committed and with --fp8-min-rows 2 (o_proj's two rows back on the quantizer + fp8, session 21's routing)
# side by side, then `nox -s test-cuda -- tests/kernels` (the skinny kernel and its tiles changed), then the engine's
# GPU end-to-end tests in what is left of 590 s. Decode results land in $OUT/results.tgz beside the suite logs.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
decode_table final
decode_table o-proj-fp8 --fp8-min-rows 2
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
(time timeout $((540 - SECONDS)) nox -s test-cuda -- tests/kernels) > $OUT/test-cuda-kernels.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-kernels.log | tail -12
(time timeout $((592 - SECONDS)) nox -s test-cuda -- tests/engine/test_engine_e2e.py \
  tests/engine/test_programmatic_launch_cuda.py tests/engine/test_fp8_rows_model.py) > $OUT/test-cuda-engine.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-engine.log | tail -8
