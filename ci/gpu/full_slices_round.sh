#!/usr/bin/env bash
# One device call on a one-GPU host (~4 min), written in session 24 after its device time: full mode's materialized
# path in L2-sized slices of weight rows (merge_planes.MATERIALIZE_SLICES, empty until this runs). The GEMM table on
# the four Llama-3.1-8B linears at 64-1,024 rows prints, where full mode materializes (65 rows up), the whole-weight
# path (`full`) beside slices of 4 / 8 / 16 MiB (`sliced-*`), with cuBLAS fp16 in the same run; then the merge
# tests on the GPU (the sliced path equals the whole-weight path at 256 x 6144 x 4096). Ran in session 25: every
# slice lost, and the sliced path and its columns were removed after it; check out 758da3c to run it again.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
timeout 330 python3 benchmarks/kernels/bench_nested_gemm.py --m 64 96 128 192 256 1024 --no-moe \
  --shapes llama3.1-8b.qkv llama3.1-8b.o llama3.1-8b.gate_up llama3.1-8b.down --out $R/gemm-full-slices.json \
  > $R/gemm-full-slices.log 2>&1
grep -E "M= *(96|128|192|256|1024)" $R/gemm-full-slices.log | sed 's/  fast\[.*full-kernel/ ... full-kernel/'
(time timeout 120 nox -s test-cuda -- tests/kernels/test_merge_planes.py) > $R/test-cuda-merge.log 2>&1
grep -E "passed|failed|real" $R/test-cuda-merge.log | tail -3
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
