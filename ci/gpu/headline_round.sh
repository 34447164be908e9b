#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes): the reduced MoE headline (Qwen3-30B-A3B shapes, 80 GB budget,
# Gamma CV 2) on GPU 0; on GPU 1 the TP=2 test first (both GPUs, uncaptured output, every rank's stacks each 45 s,
# engine phase logs), then a quarter-scale dense headline. At most 8 files come back: folders go into tarballs.
source ci/gpu/bootstrap.sh
set +e
install_packages
(
  ELASTISERVE_DEBUG_STACKS_S=45 ELASTISERVE_LOG_LEVEL=info NCCL_DEBUG=WARN timeout 190 python3 -m pytest \
    --device=cuda --gpus=2 -p no:cacheprovider -s -v --timeout 180 --log-cli-level=INFO tests/engine/test_tp_cuda.py \
    > $OUT/tp.log 2>&1
  export CUDA_VISIBLE_DEVICES=1
  timeout 330 python3 benchmarks/serving/headline.py --setting dense --scale 0.25 --requests 96 --concurrency 48 \
    --max-num-seqs 48 --policies static-fp16 elastickv dps combined --no-progress --out $OUT/dense > $OUT/dense.log 2>&1
  tar czf $OUT/dense.tgz -C $OUT dense dense.log && rm -rf $OUT/dense $OUT/dense.log
) &
BACKGROUND=$!
CUDA_VISIBLE_DEVICES=0 timeout 540 python3 benchmarks/serving/headline.py --setting moe --scale 0.25 --requests 120 \
  --rate 2 --rate 6 --policies static-fp16 dps combined --max-duration 60 --no-progress --out $OUT/moe \
  > $OUT/moe.log 2>&1
tail -12 $OUT/moe.log
tar czf $OUT/moe.tgz -C $OUT moe moe.log && rm -rf $OUT/moe $OUT/moe.log
wait $BACKGROUND
grep -E "passed|failed|Timeout|Error" $OUT/tp.log | tail -5
