#!/usr/bin/env bash
# One device call on a two-GPU host (~8 minutes), for session 5's CPU-only changes. GPU 0: elastickv on the dense
# headline at full lengths and pool, concurrency 64, 200 requests, now with base-floor admission (session 5 measured
# 2,007 preemptions without it; the simulator predicts none and 3.09 / 4.99 s mean / P90 TTFT). GPU 1: the whole CUDA
# suite on the new tree. static-fp16's side of the comparison is session 5's run (its admission did not change).
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
( CUDA_VISIBLE_DEVICES=1; export CUDA_VISIBLE_DEVICES; { time timeout 420 nox -s test-cuda; } > $OUT/test-cuda.log 2>&1 ) &
sleep 20
CUDA_VISIBLE_DEVICES=0 timeout 500 python3 benchmarks/serving/headline.py --setting dense --requests 200 \
  --concurrency 64 --max-duration 400 --policies elastickv --no-progress --out $OUT/dense > $OUT/dense.log 2>&1
tail -4 $OUT/dense.log
wait
grep -E "passed|failed" $OUT/test-cuda.log | tail -2
tar czf $OUT/dense.tgz -C $OUT dense dense.log && rm -rf $OUT/dense
