#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 minutes), session 17's third: the CUDA tests its second call did not reach
# (cut at 470 s inside test_weight_decode) with test_moe_combine (one failure there: FMA rounding at top-8), then the
# MoE headline with the MoE combine, the grouped GEMM's row gather and the quantizing norms: dps at 24 req/s with the
# queue trigger (0.5 s) and static-fp16 at 12, session 12's setting (2,048-token chunks, mixed-step graphs, the step
# budget), the two points that set the 1.75x capacity ratio.
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout 170 nox -s test-cuda -- tests/kernels/test_moe_combine.py tests/kernels/test_weight_decode.py \
  tests/kernels/test_skinny_gemm.py tests/memory tests/platforms) > $OUT/test-cuda-rest.log 2>&1
grep -E "passed|failed|FAILED" $OUT/test-cuda-rest.log | tail -8
common="$(moe_budget_args)"
timeout 230 python3 benchmarks/serving/headline.py $common --rate 24 --queue-fast-after 0.5 --out $OUT/moe-queue-dps \
  --policies dps > $OUT/moe-queue-dps.log 2>&1
tail -3 $OUT/moe-queue-dps.log
timeout $((565 - SECONDS)) python3 benchmarks/serving/headline.py $common --rate 12 --out $OUT/moe-static \
  --policies static-fp16 > $OUT/moe-static.log 2>&1
tail -3 $OUT/moe-static.log
logs=""
for d in moe-queue-dps moe-static; do
  python3 benchmarks/serving/headline.py --setting moe --out $OUT/$d --summarize 2>&1 | tee $OUT/$d-table.txt
  logs="$logs $d $d.log"
done
tar czf $OUT/runs.tgz -C $OUT $logs && (cd $OUT && rm -rf $logs)
ls $OUT
