#!/usr/bin/env bash
# One device call on a one-GPU host (~4.5 min), written in session 22, run in session 23: the fp8 GEMM's split-K
# partials summed in the GEMM launch (nested_gemm.SPLIT_K_MERGE, on for sm90 since that run).
# 1. The merge's GPU tests (bit-equal to the reduce kernel, counters back at zero), then the attention tests that
#    share arrivals.py with it.
# 2. The decode table (roofline, fast/full at batches 1-32) with --split-k-merge 0 and 1 side by side: the reduce
#    costs 36 us a batch-2 fast step (down_proj's two splits, session 22's profile).
# 3. probe_skinny_gemm.py on lm_head at two rows, plain (~30 s).
# If 1 is faster and the tests pass, set SPLIT_K_MERGE["sm90"] = True (nested_gemm.py) with the figures.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(time timeout 200 nox -s test-cuda -- tests/kernels/test_nested_gemm.py tests/kernels/test_attention.py \
  tests/kernels/test_attention_cuda.py) > $OUT/test-cuda-merge.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-merge.log | tail -8
decode_table reduce-kernel --split-k-merge 0
decode_table merged --split-k-merge 1
# lm_head (128256 x 4096, plain fp16) at two rows: cuBLAS took 238 us a batch-2 step (session 22's profile); does
# the plain skinny kernel beat it there (configs.SKINNY_MAX_M["sm90"]["plain"] is 1)?
timeout 120 python3 benchmarks/kernels/probe_skinny_gemm.py --shapes lm_head --m 2 --modes plain \
  --tiles 4,4096,16 8,2048,8 8,2048,16 4,2048,8 8,1024,8 --budget-s 90 --out $R/skinny-lm-head-m2.json \
  > $R/skinny-lm-head-m2.log 2>&1
sed -n '/^best skinny/,$p' $R/skinny-lm-head-m2.log | grep -v "^$"
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
