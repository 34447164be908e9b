#!/usr/bin/env bash
# One device call on a one-GPU host (~3 min), session 24: plain fp16 linears at two rows on the skinny kernel
# (configs.SKINNY_MAX_M["sm90"]["plain"] 1 -> 2, tile 4x2048 at 8 warps). lm_head at batch 2 and every linear of the
# static-fp16 step at batch 2 take it.
# 1. probe_skinny_gemm.py, plain, two rows: the four Llama-3.1-8B linears and lm_head against cuBLAS, five tiles.
# 2. The decode table (roofline, fast/full at 1-32) as committed and with --skinny-plain-max-rows 1, side by side.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
timeout 150 python3 benchmarks/kernels/probe_skinny_gemm.py --shapes qkv o gate_up down lm_head --m 2 --modes plain \
  --tiles 4,2048,8 4,4096,16 8,1024,8 8,2048,8 16,1024,8 --budget-s 120 --out $R/skinny-plain-m2.json \
  > $R/skinny-plain-m2.log 2>&1
sed -n '/^best skinny/,$p' $R/skinny-plain-m2.log | grep -v "^$"
decode_table committed
decode_table plain-one-row --skinny-plain-max-rows 1
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
