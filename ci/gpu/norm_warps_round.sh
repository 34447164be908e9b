#!/usr/bin/env bash
# One short device call on a one-GPU host (~1 min), session 21: the fused add + RMSNorm at 1, 2 and 4 rows of 4,096,
# plain and quantizing, at 4, 8 and 16 warps a program (benchmarks/kernels/probe_norm_warps.py).
source ci/gpu/bootstrap.sh
set +e
install_packages
timeout ${LIMIT:-90} python3 benchmarks/kernels/probe_norm_warps.py --out $OUT/norm-warps.json > $OUT/norm-warps.log 2>&1
cat $OUT/norm-warps.log | grep -v "^$" | tail -12
