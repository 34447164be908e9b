#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes). GPU 1: the whole CUDA suite (the TP=2 suite beside it at the
# start, on both GPUs), then the reduced dense headline for elastickv and combined, then combined's ShareGPT
# throughput. GPU 0, after the TP test: the skinny GEMM probe, then the reduced MoE headline.
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
(
  export CUDA_VISIBLE_DEVICES=1
  sleep 20  # the TP session installs the packages first: two editable installs at once race on the egg-info
  { time timeout 270 nox -s test-cuda; } > $OUT/test-cuda.log 2>&1
  timeout 110 python3 benchmarks/serving/headline.py --setting dense --scale 0.25 --requests 96 --concurrency 48 \
    --max-num-seqs 48 --policies elastickv combined --no-progress --out $OUT/dense > $OUT/dense.log 2>&1
  mkdir -p $OUT/dense
  timeout 140 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b --parts throughput --requests 1000 \
    --throughput-kv-gib 16 --policies combined --out $OUT/dense/throughput_combined.json \
    > $OUT/dense/throughput_combined.log 2>&1
  tar czf $OUT/dense.tgz -C $OUT dense dense.log && rm -rf $OUT/dense $OUT/dense.log
) &
BACKGROUND=$!
{ time ELASTISERVE_DEBUG_STACKS_S=60 timeout 110 nox -s test-cuda-multi; } > $OUT/test-cuda-multi.log 2>&1
tail -3 $OUT/test-cuda-multi.log
export CUDA_VISIBLE_DEVICES=0
timeout 190 python3 benchmarks/kernels/probe_skinny_gemm.py --budget-s 170 --out $OUT/skinny.json \
  > $OUT/skinny.log 2>&1
tail -30 $OUT/skinny.log
timeout 240 python3 benchmarks/serving/headline.py --setting moe --scale 0.25 --requests 120 --rate 2 --rate 6 \
  --policies static-fp16 dps combined --max-duration 30 --no-progress --out $OUT/moe > $OUT/moe.log 2>&1
tail -8 $OUT/moe.log
tar czf $OUT/moe.tgz -C $OUT moe moe.log && rm -rf $OUT/moe $OUT/moe.log
wait $BACKGROUND
grep -E "passed|failed" $OUT/test-cuda.log | tail -2
