#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 min), session 22: the skinny GEMM's new sm90 tiles in the engine.
# 1. The GEMM table at one row (bench_nested_gemm.py, the four Llama-3.1-8B linears): fp8 on quantized rows against
#    the weight-only skinny kernel, side by side.
# 2. The decode table (roofline, fast/full at batches 1-32) as committed; with --fp8-one-row-min-n 16384 (qkv at one
#    row weight-only, its norm plain); with --fp8-min-rows-quantized 2 (qkv and gate_up); then the previous tree's
#    skinny_gemm.py, configs.py and rms_norm.py (.carry/old) side by side.
# 3. `nox -s test-cuda` on tests/control, engine, memory and platforms in what is left of 585 s.
# Everything lands in one archive ($OUT/results.tgz) beside the suite's log.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
timeout 120 python3 benchmarks/kernels/bench_nested_gemm.py --m 1 --no-moe --shapes llama3.1-8b.qkv llama3.1-8b.o \
  llama3.1-8b.gate_up llama3.1-8b.down --out $R/gemm-m1.json > $R/gemm-m1.log 2>&1
grep -v "^$" $R/gemm-m1.log | tail -14
decode_table tiles
decode_table qkv-weight-only --fp8-one-row-min-n 16384
decode_table one-row-weight-only --fp8-min-rows-quantized 2
mkdir -p /tmp/new && for f in $(cd .carry/old && find . -type f); do mkdir -p /tmp/new/$(dirname $f); cp $f /tmp/new/$f; done
cp -r .carry/old/. .
decode_table baseline
cp -r /tmp/new/. .
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
(time timeout $((585 - SECONDS)) nox -s test-cuda -- tests/control tests/engine tests/memory tests/platforms) \
  > $OUT/test-cuda-rest.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-rest.log | tail -12
