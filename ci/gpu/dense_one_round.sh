#!/usr/bin/env bash
# One device call on a one-GPU host: dense headline policies one after another (Llama-3.1-8B shapes, 4096 prompt /
# 1024 output tokens and a 20 GB KV pool, times SCALE), for when no two-GPU host is lent. Defaults: POLICIES=static-
# fp16, the ElasticKV paper's concurrency 38, all 600 requests, each policy cut at MAX_DURATION=500 s (session 6: 400
# full-size requests took 214 s / 243 s of serving plus ~50 s of engine build and warm-up), the call at LIMIT=570 s.
# Session 44's side-by-side table: POLICIES="combined dps elastickv static-fp16" SCALE=0.5 REQUESTS=400
# MAX_DURATION=100, then the same at full size with REQUESTS=160. ``T_BASE`` (seconds) passes one T_base; unset,
# the first policy's engine measures it. ``EXTRA``: more headline.py arguments (``--queue-fast-after 0.1``: dps and
# combined run every layer fast while a prompt waits, session 45's simulator plan).
# ``PROFILE=1``: the whole call under cProfile (dense/headline.prof), for the host time between steps that session
# 46 found in elastickv's and combined's timelines (2.3 / 1.95 ms a step against static-fp16's 0.46 ms).
source ci/gpu/bootstrap.sh
set +e
start_round
POLICIES=${POLICIES:-static-fp16} CONCURRENCY=${CONCURRENCY:-38} REQUESTS=${REQUESTS:-600}
PROFILER=${PROFILE:+-m cProfile -o $OUT/dense/headline.prof}
(time timeout ${LIMIT:-570} python3 $PROFILER benchmarks/serving/headline.py --setting dense --requests $REQUESTS \
  --scale ${SCALE:-1.0} --concurrency $CONCURRENCY --max-duration ${MAX_DURATION:-500} ${T_BASE:+--t-base $T_BASE} \
  --policies $POLICIES --no-progress --out $OUT/dense ${EXTRA:-}) > $OUT/dense.log 2>&1
tail -12 $OUT/dense.log
python3 benchmarks/serving/headline.py --setting dense --out $OUT/dense --summarize > $OUT/dense-table.txt 2>&1
cat $OUT/dense-table.txt
# One archive: the call returns at most 8 files, and each policy writes three.
tar czf $OUT/dense.tgz -C $OUT dense && rm -rf $OUT/dense
