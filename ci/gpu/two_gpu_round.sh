#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes), the GPUs used side by side:
#   GPU 1: bench_nested_gemm, then bench_decode (a)-(c), then ShareGPT throughput for elastickv and combined;
#   GPU 0: the whole CUDA suite, then ShareGPT throughput for static-fp16, static-fp8 and dps;
#   both:  the TP=2 suite at the end. At most 8 files come back: the throughput JSON rows are in the logs.
source ci/gpu/bootstrap.sh
set +e
install_packages
TP="--parts throughput --requests 1000 --throughput-kv-gib 16"
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 200 python3 benchmarks/kernels/bench_nested_gemm.py --out $OUT/bench_nested_gemm.json \
    > $OUT/bench_nested_gemm.log 2>&1
  timeout 150 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b --parts roofline fast_full switch \
    --batch 1 4 16 32 64 --kv-gib 12 --trials 5 --iters 30 --out $OUT/bench_decode.json > $OUT/bench_decode.log 2>&1
  timeout 150 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b $TP --policies elastickv combined \
    --out /tmp/throughput_b.json > $OUT/throughput_b.log 2>&1
) &
BACKGROUND=$!
{ nvidia-smi -L; git log -1 --format=%H; time CUDA_VISIBLE_DEVICES=0 timeout 280 nox -s test-cuda; } \
  > $OUT/test-cuda.log 2>&1
tail -3 $OUT/test-cuda.log
CUDA_VISIBLE_DEVICES=0 timeout 210 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b $TP \
  --policies static-fp16 static-fp8 dps --out /tmp/throughput_a.json > $OUT/throughput_a.log 2>&1
wait $BACKGROUND
{ time timeout 60 nox -s test-cuda-multi; } > $OUT/test-cuda-multi.log 2>&1
tail -3 $OUT/test-cuda-multi.log
tail -14 $OUT/bench_decode.log; grep -h "^throughput" $OUT/throughput_*.log; tail -30 $OUT/bench_nested_gemm.log
