#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes from a cold Triton cache): the whole CUDA suite on GPU 0 beside
# the engine decode benchmark and the dps ShareGPT throughput on GPU 1, then the TP=2 suite with stack dumps.
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b --parts roofline fast_full switch \
    --batch 1 4 16 32 64 --kv-gib 12 --trials 5 --iters 30 --out $OUT/bench_decode.json > $OUT/bench_decode.log 2>&1
  timeout 140 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b --parts throughput --requests 1000 \
    --throughput-kv-gib 16 --policies dps --out $OUT/throughput_dps.json > $OUT/throughput_dps.log 2>&1
) &
BACKGROUND=$!
{ time CUDA_VISIBLE_DEVICES=0 timeout 300 nox -s test-cuda; } > $OUT/test-cuda.log 2>&1; tail -4 $OUT/test-cuda.log
wait $BACKGROUND
tail -14 $OUT/bench_decode.log; grep -h "^throughput" $OUT/throughput_dps.log
# Every rank dumps its stacks each 90 s (faulthandler), so a stall shows where each one waits.
{ time ELASTISERVE_DEBUG_STACKS_S=90 timeout 250 nox -s test-cuda-multi; } > $OUT/test-cuda-multi.log 2>&1
tail -4 $OUT/test-cuda-multi.log
