#!/usr/bin/env bash
# One device call on a two-GPU host: the whole CUDA suite, then the TP=2 suite with stack dumps, logs under $OUT.
# About 9.5 minutes from a cold Triton cache: give it the whole 600 s call.
source ci/gpu/bootstrap.sh
set +e
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
{ time timeout 300 nox -s test-cuda; } > $OUT/test-cuda.log 2>&1; tail -4 $OUT/test-cuda.log
# Every rank dumps its stacks each 90 s (faulthandler), so a stall shows where each one waits.
{ time ELASTISERVE_DEBUG_STACKS_S=90 timeout 270 nox -s test-cuda-multi; } > $OUT/test-cuda-multi.log 2>&1
tail -4 $OUT/test-cuda-multi.log
