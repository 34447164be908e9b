#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 minutes), session 8: the mixed-graph CUDA test (its first run failed on
# the test's own prompt ids, outside the tiny model's 97 tokens), then the MoE headline (moe_headline's setting,
# 2,048-token chunks) with --mixed-graphs for static-fp16 and dps at 4 and 8 req/s (RATES), to set beside session
# 7's eager moe-full-lengths-run4: static-fp16 met the joint SLO for 86.8 % of requests at 4 req/s, dps 32.6 %.
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
timeout 120 python3 -m pytest -q --device=cuda -p no:cacheprovider tests/engine/test_mixed_graphs_cuda.py \
  > $OUT/mixed-graphs-test.log 2>&1
tail -2 $OUT/mixed-graphs-test.log
rates=""; for r in ${RATES:-4 8}; do rates="$rates --rate $r"; done
timeout $((585 - SECONDS)) python3 benchmarks/serving/headline.py --setting moe --requests 400 $rates \
  --max-duration 60 --t-base ${T_BASE:-0.02465} --no-progress --out $OUT/moe --max-num-batched-tokens 2048 \
  --mixed-graphs --policies ${POLICIES:-static-fp16 dps} > $OUT/moe.log 2>&1
tail -3 $OUT/moe.log
moe_table
tar czf $OUT/runs.tgz -C $OUT moe moe.log && rm -rf $OUT/moe $OUT/moe.log
ls $OUT
