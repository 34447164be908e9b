#!/usr/bin/env bash
# One device call on a one-GPU host (~9 min): the MoE headline's dps at RATE (24 unless set) with automatic garbage
# collection (--no-gc-shadow, as before session 15) and then with the collector's passes in the device's shadow (the
# default since), each under LIMIT seconds (230 unless set), 2,048-token chunks, the queue trigger at 0.5 s; then the
# longest host gaps between steps of both runs with the collector's seconds in each (benchmarks/serving/step_gaps.py).
source ci/gpu/bootstrap.sh
set +e
start_round
common="$(moe_budget_args) --rate ${RATE:-24} --queue-fast-after 0.5 --policies dps"
timeout ${LIMIT:-230} python3 benchmarks/serving/headline.py $common --no-gc-shadow --out $OUT/gc-auto \
  > $OUT/gc-auto.log 2>&1
tail -2 $OUT/gc-auto.log
timeout ${LIMIT:-230} python3 benchmarks/serving/headline.py $common --out $OUT/gc-shadow > $OUT/gc-shadow.log 2>&1
tail -2 $OUT/gc-shadow.log
python3 benchmarks/serving/step_gaps.py $OUT/gc-auto/*.json.gz $OUT/gc-shadow/*.json.gz 2>&1 | tee $OUT/step-gaps.txt
for d in gc-auto gc-shadow; do
  python3 benchmarks/serving/headline.py --setting moe --out $OUT/$d --summarize > $OUT/$d-table.txt 2>&1
done
tar czf $OUT/runs.tgz -C $OUT gc-auto gc-shadow gc-auto.log gc-shadow.log && rm -rf $OUT/gc-auto $OUT/gc-shadow \
  $OUT/gc-auto.log $OUT/gc-shadow.log
ls $OUT
