#!/usr/bin/env bash
# One device call on a one-GPU host (~8 min), written in session 29: the attention kernels' pipeline stages, never
# timed. Compiled for sm90 on the CPU (compile_report.py), 3 stages instead of 2 give the native decode kernel 96
# registers and 14 async copies against 114 and 8 (5 CTAs per SM instead of 4), path 3's BASE launch 7 async copies
# against 4 at the same 104 registers, and path 3's TARGET launch 118 registers against 96. All-BASE is 1.47x native
# (target 1.7x) and reads its half of the bytes at 3.2 TB/s against native's 4.3.
# 1. bench_attention.py --sweep at batch 64 x 4,096 (the shape) and at batch 4 x 1,024 in tables for 8,192
#    tokens (a decode graph's case): every case at each setting of bench_attention.SWEEP_SETTINGS, side by side.
# 2. The decode table as committed and with --attention-stages 3.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(cd benchmarks/kernels && timeout 200 python3 bench_attention.py --sweep stages --out $R/attention-sweep-64x4096.json \
  > $R/attention-sweep-64x4096.log 2>&1)
cat $R/attention-sweep-64x4096.log | grep -v "^\s*$" | tail -20
(cd benchmarks/kernels && timeout 120 python3 bench_attention.py --sweep stages --batch 4 --context 1024 --table-tokens 8192 \
  --out $R/attention-sweep-4x1024.json > $R/attention-sweep-4x1024.log 2>&1)
grep "^{" $R/attention-sweep-4x1024.log
decode_table committed
decode_table stages-3 --attention-stages 3
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
