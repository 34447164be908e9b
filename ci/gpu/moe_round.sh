#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes), for what is still unmeasured. GPU 0: the reduced MoE headline
# (Qwen3-30B-A3B shapes, 80 GB budget, Gamma CV 2; static-fp16, dps and combined side by side in one process).
# GPU 1: the whole CUDA suite, then the reduced dense headline with all five policies side by side.
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
(
  export CUDA_VISIBLE_DEVICES=1
  { time timeout 340 nox -s test-cuda; } > $OUT/test-cuda.log 2>&1
  # The dense run gets what is left of the call after the suite.
  timeout $((565 - SECONDS)) python3 benchmarks/serving/headline.py --setting dense --scale 0.25 --requests 96 --concurrency 48 \
    --max-num-seqs 48 --no-progress --out $OUT/dense > $OUT/dense.log 2>&1
  tar czf $OUT/dense.tgz -C $OUT dense dense.log && rm -rf $OUT/dense $OUT/dense.log
) &
BACKGROUND=$!
CUDA_VISIBLE_DEVICES=0 timeout 540 python3 benchmarks/serving/headline.py --setting moe --scale 0.25 --requests 120 \
  --rate 2 --rate 6 --policies static-fp16 dps combined --max-duration 45 --no-progress --out $OUT/moe \
  > $OUT/moe.log 2>&1
tail -8 $OUT/moe.log
tar czf $OUT/moe.tgz -C $OUT moe moe.log && rm -rf $OUT/moe $OUT/moe.log
wait $BACKGROUND
grep -E "passed|failed" $OUT/test-cuda.log | tail -2
