#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 minutes), session 8: the mixed-graph CUDA test (its first run failed on
# the test's own prompt ids, outside the tiny model's 97 tokens), then the MoE headline (moe_headline's setting,
# 2,048-token chunks) with --mixed-graphs for static-fp16 and dps at 4 and 8 req/s (RATES), to set beside session
# 7's eager moe-full-lengths-run4: static-fp16 met the joint SLO for 86.8 % of requests at 4 req/s, dps 32.6 %.
# Run 1 (session 8, lazy capture): 49.8 % and 26.4 %, the captures' 200-250 ms steps; run 2 captures before serving,
# with finer token buckets, and ends with the mixed-step profile (~1 min). EXTRA: more headline.py arguments (e.g.
# `--max-step-time 0.11`, the step-time token budget, for dps's full-mode steps of 123-135 ms in run 2).
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
timeout 120 python3 -m pytest -q --device=cuda -p no:cacheprovider tests/engine/test_mixed_graphs_cuda.py \
  > $OUT/mixed-graphs-test.log 2>&1
tail -2 $OUT/mixed-graphs-test.log
rates=""; for r in ${RATES:-4 8}; do rates="$rates --rate $r"; done
timeout $((520 - SECONDS)) python3 benchmarks/serving/headline.py --setting moe --requests 400 $rates \
  --max-duration 60 --t-base ${T_BASE:-0.02465} --no-progress --out $OUT/moe --max-num-batched-tokens 2048 \
  --mixed-graphs --policies ${POLICIES:-static-fp16 dps} ${EXTRA:-} > $OUT/moe.log 2>&1
tail -3 $OUT/moe.log
moe_table
(cd benchmarks/engine && timeout $((590 - SECONDS)) python3 profile_mixed_step.py \
  --model qwen3-30b-a3b --policies static-fp16 --gpu-memory-budget 80e9 --batch 64 --context 1024 \
  --chunk 512 1024 2048 --repeats 4 --mixed-graphs --out $OUT/mixed-step-profile.json \
  > $OUT/mixed-step-profile.log 2>&1)
grep -v "^USDT\|profiler_st" $OUT/mixed-step-profile.log | tail -4
tar czf $OUT/runs.tgz -C $OUT moe moe.log && rm -rf $OUT/moe $OUT/moe.log
ls $OUT
