#!/usr/bin/env bash
# One device call on a one-GPU host: policies with --queue-fast-after (every layer in FP8 while a request has waited
# QUEUE_FAST s for its first token, residuals kept) on the MoE headline, then static-fp16 to refine the capacity grid.
# The setting is session 9's (2,048-token chunks, mixed-step graphs, --max-step-time 0.11).
#   RUNS: "policy:rate,rate,...:seconds ..." (default "dps:14,16:330"), each run under its own time limit
#   STATIC_RATES: static-fp16's rates, under what is left of 575 s (default 10; empty: none)
#   EXTRA: more headline.py arguments for every run (for example "--max-num-seqs 512")
# Session 11, call 1 (RUNS="dps:14,16,18:390"): dps 14.0 / 100 / 100 % at 14 / 16 / 18 req/s, static-fp16 100 % at 10;
# the 14 point was the step budget's lock (packages/control/src/elastiserve/control/step_budget.py), since fixed.
# Session 12 ran it four times (BENCHMARKS.md, "Session 12").
# Session 13 ran it three times: 512 slots, combined at 24 req/s, 3,072-token chunks (BENCHMARKS.md, "Session 13").
# Session 14 ran it twice at 3,072-token chunks (BENCHMARKS.md, "Session 14").
source ci/gpu/bootstrap.sh
set +e
start_round
common="$(moe_budget_args) ${EXTRA:-}"
dirs=""
for run in ${RUNS:-dps:14,16:330}; do
  IFS=: read -r policy rates limit <<< "$run"
  args=""; for r in ${rates//,/ }; do args="$args --rate $r"; done
  timeout $limit python3 benchmarks/serving/headline.py $common $args --queue-fast-after ${QUEUE_FAST:-0.5} \
    --out $OUT/moe-queue-$policy --policies $policy > $OUT/moe-queue-$policy.log 2>&1
  tail -3 $OUT/moe-queue-$policy.log
  dirs="$dirs moe-queue-$policy"
done
static=""; for r in ${STATIC_RATES-10}; do static="$static --rate $r"; done
if [ -n "$static" ]; then
  timeout $((575 - SECONDS)) python3 benchmarks/serving/headline.py $common $static --out $OUT/moe-static \
    --policies static-fp16 > $OUT/moe-static.log 2>&1
  tail -3 $OUT/moe-static.log
  dirs="$dirs moe-static"
fi
logs=""
for d in $dirs; do
  python3 benchmarks/serving/headline.py --setting moe --out $OUT/$d --summarize 2>&1 | tee $OUT/$d-table.txt
  logs="$logs $d $d.log"
done
tar czf $OUT/runs.tgz -C $OUT $logs && (cd $OUT && rm -rf $logs)
ls $OUT
