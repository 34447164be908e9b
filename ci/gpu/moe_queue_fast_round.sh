#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 minutes), written in session 10 and not run yet: dps with
# --queue-fast-after (every layer in FP8 while a request has waited QUEUE_FAST s for its first token, residuals
# kept) on the MoE headline at 14 / 16 req/s (RATES; DPS_LIMIT s, 330 unless set), then static-fp16 at 10 req/s (STATIC_RATES) to refine the
# capacity grid. The setting is session 9's (2,048-token chunks, mixed-step graphs, --max-step-time 0.11). Without the
# trigger dps held 97.8 / 87.0 / 82.2 % of the joint SLO at 12 / 14 / 16 req/s. Every miss was a TTFT miss, and every
# one arrived while dps still ran full mode below kappa_high (packages/control/README.md, "Precision as compute").
source ci/gpu/bootstrap.sh
set +e
start_round
common=$(moe_budget_args)
rates=""; for r in ${RATES:-14 16}; do rates="$rates --rate $r"; done
timeout ${DPS_LIMIT:-330} python3 benchmarks/serving/headline.py $common $rates --queue-fast-after ${QUEUE_FAST:-0.5} \
  --out $OUT/moe-queue --policies dps > $OUT/moe-queue.log 2>&1
tail -3 $OUT/moe-queue.log
static=""; for r in ${STATIC_RATES:-10}; do static="$static --rate $r"; done
timeout $((575 - SECONDS)) python3 benchmarks/serving/headline.py $common $static --out $OUT/moe-static \
  --policies static-fp16 > $OUT/moe-static.log 2>&1
tail -3 $OUT/moe-static.log
for d in moe-queue moe-static; do
  python3 benchmarks/serving/headline.py --setting moe --out $OUT/$d --summarize 2>&1 | tee $OUT/$d-table.txt
done
tar czf $OUT/runs.tgz -C $OUT moe-queue moe-queue.log moe-static moe-static.log && \
  rm -rf $OUT/moe-queue $OUT/moe-queue.log $OUT/moe-static $OUT/moe-static.log
ls $OUT
