#!/usr/bin/env bash
# One device call on a two-GPU host: the whole CUDA suite, the TP=2 suite, then the GEMM tile/decode probe and the
# attention benchmark (paths 0-3), logs and JSON under $OUT. About 9 minutes on H200s: give it the whole 600 s call.
source ci/gpu/bootstrap.sh
set +e
export ELASTISERVE_TRACE_DIR=$PWD/.carry/traces
nvidia-smi -L > $OUT/gpus.txt 2>&1; git log -1 --format=%H >> $OUT/gpus.txt 2>/dev/null
{ time timeout 280 nox -s test-cuda; } > $OUT/test-cuda.log 2>&1; tail -4 $OUT/test-cuda.log
{ time timeout 110 nox -s test-cuda-multi; } > $OUT/test-cuda-multi.log 2>&1; tail -4 $OUT/test-cuda-multi.log
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e packages/platforms -e packages/memory \
  -e packages/kernels -e packages/control -e packages/engine >/dev/null 2>&1
timeout 95 python3 benchmarks/kernels/probe_gemm_configs.py --shapes qkv down --parts decode --out $OUT/probe.json \
  > $OUT/probe.log 2>&1; tail -30 $OUT/probe.log
timeout 80 python3 benchmarks/kernels/bench_attention.py --out $OUT/bench_attention.json > $OUT/bench_attention.log 2>&1
tail -25 $OUT/bench_attention.log
