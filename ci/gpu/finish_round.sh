#!/usr/bin/env bash
# One device call on a two-GPU host (~9 minutes) finishing what two_gpu_round.sh's time limits cut:
#   GPU 1: ShareGPT throughput for dps and combined, then the weight-only PTX decode probe;
#   GPU 0: the CUDA tests after tests/kernels/test_nested_moe.py, then a reduced MoE headline run;
#   both:  the TP=2 suite. At most 8 files come back.
source ci/gpu/bootstrap.sh
set +e
install_packages
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 200 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b --parts throughput --requests 1000 \
    --throughput-kv-gib 16 --policies dps combined --out /tmp/throughput_c.json > $OUT/throughput_c.log 2>&1
  timeout 100 python3 benchmarks/kernels/probe_gemm_configs.py --shapes qkv down --parts decode \
    --modes weight_only weight_only_ptx fp8 --out $OUT/probe.json > $OUT/probe.log 2>&1
) &
BACKGROUND=$!
{ time CUDA_VISIBLE_DEVICES=0 timeout 110 python3 -m pytest --device=cuda -q -p no:cacheprovider \
    tests/kernels/test_nested_moe.py tests/kernels/test_weight_decode.py tests/memory tests/platforms; } \
  > $OUT/test-cuda-rest.log 2>&1
tail -3 $OUT/test-cuda-rest.log
CUDA_VISIBLE_DEVICES=0 timeout 250 python3 benchmarks/serving/headline.py --setting moe --scale 0.25 --requests 80 \
  --rate 4 --policies static-fp16 dps --max-duration 70 --no-progress --out $OUT/moe > $OUT/moe.log 2>&1
tail -8 $OUT/moe.log
tar czf $OUT/moe.tgz -C $OUT moe moe.log && rm -rf $OUT/moe
wait $BACKGROUND
{ time timeout 150 python3 -m pytest --device=cuda --gpus=2 -q -p no:cacheprovider; } \
  > $OUT/test-cuda-multi.log 2>&1
tail -3 $OUT/test-cuda-multi.log; grep -h "^throughput" $OUT/throughput_c.log; tail -24 $OUT/probe.log
