#!/usr/bin/env bash
# One device call on a one-GPU host (~6.5 min), session 30: the rest of `nox -s test-cuda` (control, engine, memory,
# platforms; last on the GPU at 612d4f4), then what lm_head_round.sh's last part could not time: the decode step at
# batches 64 and 128 as committed and with --nest-lm-head (full mode from 65 rows merges a nested weight into
# scratch before cuBLAS, so a nested lm_head pays that there). Its first run failed on the benchmark's setup (the
# first requests finished their 8 tokens while the last prefilled; fixed in decode_setup.decode_inputs).
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout ${SUITE_LIMIT:-250} nox -s test-cuda -- tests/control tests/engine tests/memory tests/platforms) \
  > $OUT/test-cuda-rest.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-rest.log | tail -12
R=$OUT/r; mkdir -p $R
for v in committed nest-lm-head; do
  timeout 120 python3 benchmarks/engine/bench_decode.py --parts fast_full --batch 64 128 --kv-gib 16 --iters 20 \
    --trials 3 --out $R/decode-large-$v.json $([ $v = nest-lm-head ] && echo --nest-lm-head) > $R/decode-large-$v.log 2>&1
  echo "== decode large $v"; sed -n "/^(b)/,/^results/p" $R/decode-large-$v.log; tail -2 $R/decode-large-$v.log
done
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
