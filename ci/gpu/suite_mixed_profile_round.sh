#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 minutes), sessions 8 and 9's first: only single H200s were lent. Session 9's
# suite was cut at 400 s (285 of 314 passed); the limit is 520 s (SUITE_LIMIT) and the profile runs only if 150 s
# are left (PROFILE=0: never).
# `nox -s test-cuda` alone on the final tree (4 min 44 s alone in session 7; it includes the never-run
# tests/engine/test_mixed_graphs_cuda.py), then the static-fp16 mixed-step profile with --mixed-graphs, to set
# beside benchmarks/engine/results/h200-mixed-step-profile-run1 (eager: 86-94 ms a step at batch 64 + one chunk).
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
(time timeout ${SUITE_LIMIT:-520} nox -s test-cuda) > $OUT/test-cuda.log 2>&1
tail -3 $OUT/test-cuda.log
[ "${PROFILE:-1}" = 1 ] && [ $SECONDS -lt 440 ] && (cd benchmarks/engine && timeout $((585 - SECONDS)) python3 profile_mixed_step.py \
  --model qwen3-30b-a3b --policies static-fp16 --gpu-memory-budget 80e9 --batch 64 --context 1024 \
  --chunk 512 1024 2048 --repeats 4 --mixed-graphs --out $OUT/mixed-step-profile.json \
  > $OUT/mixed-step-profile.log 2>&1)
grep -v "^USDT\|profiler_st" $OUT/mixed-step-profile.log | tail -6
ls $OUT
