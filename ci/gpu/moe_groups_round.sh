#!/usr/bin/env bash
# One device call on a one-GPU host (~9 minutes), session 10's first: combined on the MoE headline with whole layer
# groups (4 groups of 12 layers) and every group prefix's graphs captured before serving, at 12 / 16 req/s, the
# setting of session 9's moe_step_budget_round.sh (combined there: 12.5 / 24.5 % from per-mix graph misses; dps
# 97.8 / 82.2 %). Then dps alone at 14 req/s (DPS_RATE) to refine the capacity grid (8 / 12 / 16 in session 9).
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
common="--setting moe --requests 400 --max-duration 60 --t-base ${T_BASE:-0.02465} --no-progress
  --max-num-batched-tokens 2048 --mixed-graphs --max-step-time ${MAX_STEP_TIME:-0.11}"
timeout 380 python3 benchmarks/serving/headline.py $common --rate 12 --rate 16 --out $OUT/moe \
  --policies combined > $OUT/moe.log 2>&1
tail -3 $OUT/moe.log
grep -h "warm-up" $OUT/moe.log
timeout $((570 - SECONDS)) python3 benchmarks/serving/headline.py $common --rate ${DPS_RATE:-14} --out $OUT/moe-dps \
  --policies dps > $OUT/moe-dps.log 2>&1
tail -3 $OUT/moe-dps.log
moe_table
python3 benchmarks/serving/headline.py --setting moe --out $OUT/moe-dps --summarize 2>&1 | tee $OUT/moe-dps-table.txt
tar czf $OUT/runs.tgz -C $OUT moe moe.log moe-dps moe-dps.log && rm -rf $OUT/moe $OUT/moe.log $OUT/moe-dps $OUT/moe-dps.log
ls $OUT
