#!/usr/bin/env bash
# One device call on a one-GPU host (~9 minutes): combined on the MoE headline with whole layer groups (4 groups of
# 12 layers) and every group prefix's graphs captured before serving, at 12 / 16 req/s, the setting of session 9's
# moe_step_budget_round.sh (combined there: 12.5 / 24.5 % from per-mix graph misses; dps 97.8 / 82.2 %).
# Session 10's first call ran this with dps at 14 req/s after it: combined's 500 graphs took 196 s, its run was cut
# by a 380 s limit before its first point, so the prefixes now capture without warm-up forwards and combined runs
# alone, first after the CUDA test of those graphs.
source ci/gpu/bootstrap.sh
set +e
start_round
timeout 100 python3 -m pytest -q --device=cuda -p no:cacheprovider tests/engine/test_group_prefix_graphs_cuda.py \
  > $OUT/group-graphs-test.log 2>&1
tail -2 $OUT/group-graphs-test.log
timeout $((${LIMIT:-540} - SECONDS)) python3 benchmarks/serving/headline.py $(moe_budget_args) --rate 12 --rate 16 \
  --out $OUT/moe --policies combined > $OUT/moe.log 2>&1
tail -3 $OUT/moe.log
grep -h "warm-up" $OUT/moe.log
moe_table
tar czf $OUT/runs.tgz -C $OUT moe moe.log && rm -rf $OUT/moe $OUT/moe.log
ls $OUT
