#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes) for what has never run: the MoE headline (Qwen3-30B-A3B shapes,
# 80 GB budget, Gamma CV 2, reduced) on GPU 0; ShareGPT throughput for combined, then a half-scale dense headline
# run on GPU 1. At most 8 files come back: each headline folder is packed into one tarball.
source ci/gpu/bootstrap.sh
set +e
install_packages
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b --parts throughput --requests 1000 \
    --throughput-kv-gib 16 --policies combined --out $OUT/throughput_combined.json > $OUT/throughput_combined.log 2>&1
  timeout 390 python3 benchmarks/serving/headline.py --setting dense --scale 0.5 --requests 128 --concurrency 64 \
    --max-num-seqs 64 --no-progress --out $OUT/dense > $OUT/dense.log 2>&1
  tar czf $OUT/dense.tgz -C $OUT dense dense.log && rm -rf $OUT/dense $OUT/dense.log
) &
BACKGROUND=$!
CUDA_VISIBLE_DEVICES=0 timeout 540 python3 benchmarks/serving/headline.py --setting moe --scale 0.25 --requests 120 \
  --rate 2 --rate 6 --policies static-fp16 dps combined --max-duration 60 --no-progress --out $OUT/moe \
  > $OUT/moe.log 2>&1
tail -12 $OUT/moe.log
tar czf $OUT/moe.tgz -C $OUT moe moe.log && rm -rf $OUT/moe $OUT/moe.log
wait $BACKGROUND
grep -h "^throughput" $OUT/throughput_combined.log
