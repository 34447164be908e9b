#!/usr/bin/env bash
# One device call on a one-GPU host: one policy of the dense headline at full lengths and the full 20 GB KV pool
# (Llama-3.1-8B shapes, 4096 prompt / 1024 output tokens), for when no two-GPU host is lent and the two policies run
# in consecutive calls on the same warm machine. Defaults: POLICY=static-fp16, the ElasticKV paper's concurrency 38,
# all 600 requests, cut at MAX_DURATION=500 s (session 6: 400 requests took 214 s / 243 s of serving plus ~50 s of
# engine build and warm-up). ``T_BASE`` (seconds) passes one T_base; unset, the engine measures its own.
source ci/gpu/bootstrap.sh
set +e
start_round
POLICY=${POLICY:-static-fp16} CONCURRENCY=${CONCURRENCY:-38} REQUESTS=${REQUESTS:-600} MAX_DURATION=${MAX_DURATION:-500}
(time timeout $((MAX_DURATION + 80)) python3 benchmarks/serving/headline.py --setting dense --requests $REQUESTS \
  --concurrency $CONCURRENCY --max-duration $MAX_DURATION ${T_BASE:+--t-base $T_BASE} --policies $POLICY \
  --no-progress --out $OUT/dense) > $OUT/dense-$POLICY.log 2>&1
tail -6 $OUT/dense-$POLICY.log
