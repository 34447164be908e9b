#!/usr/bin/env bash
# One device call on a one-GPU host (~6.5 min), session 22: the skinny GEMM with per-load (VEC) accumulators (one-row
# weight-only 64 -> 30 registers compiled for sm90) and the norms' weight load issued with x's.
# 1. probe_skinny_gemm.py at one row, all three modes and the four Llama-3.1-8B linears, over tiles that the lower
#    register count opens (more bytes in flight per SM); then full and weight-only at two rows.
# 2. probe_norm_warps.py and the decode table (roofline, fast/full at batches 1-32), this tree, then the same with the
#    previous tree's skinny_gemm.py, configs.py and rms_norm.py (.carry/old) side by side.
# Everything lands in one archive ($OUT/results.tgz).
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
TILES_M1="8,1024,8 16,1024,8 8,512,4 4,2048,8 8,2048,8 8,2048,16 4,4096,16 8,4096,16 16,2048,16"
timeout 250 python3 benchmarks/kernels/probe_skinny_gemm.py --m 1 --tiles $TILES_M1 --budget-s 200 \
  --out $R/skinny-m1.json > $R/skinny-m1.log 2>&1
sed -n '/^best skinny/,$p' $R/skinny-m1.log | grep -v "^$"
timeout 90 python3 benchmarks/kernels/probe_skinny_gemm.py --m 2 --modes full weight_only \
  --tiles 8,512,4 8,1024,8 4,2048,8 8,2048,16 4,4096,16 --budget-s 60 --out $R/skinny-m2.json > $R/skinny-m2.log 2>&1
sed -n '/^best skinny/,$p' $R/skinny-m2.log | grep -v "^$"
bench() {  # NAME
  timeout 60 python3 benchmarks/kernels/probe_norm_warps.py --out $R/norm-$1.json > $R/norm-$1.log 2>&1
  echo "== norms $1"; grep -v "^$" $R/norm-$1.log | tail -9
  timeout 120 python3 benchmarks/engine/bench_decode.py --parts roofline fast_full --batch 1 2 4 8 16 32 \
    --kv-gib 12 --iters 30 --trials 5 --out $R/decode-$1.json > $R/decode-$1.log 2>&1
  echo "== decode $1"; sed -n "/^(a)/,/^results/p" $R/decode-$1.log
}
bench vec
mkdir -p /tmp/new && for f in $(cd .carry/old && find . -type f); do mkdir -p /tmp/new/$(dirname $f); cp $f /tmp/new/$f; done
cp -r .carry/old/. .
bench baseline
cp -r /tmp/new/. .
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
