#!/usr/bin/env bash
# One device call on a one-GPU host (~9 minutes), session 16's first: `nox -s test-cuda` on the final tree (limit
# SUITE_LIMIT, 440 s; 6 min 22 s at b9aa6f3), then the vendor-FP8 probe (fast mode through `torch._scaled_mm` on the
# upper plane against our Triton fp8 path and cuBLAS fp16) in what is left of 585 s.
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout ${SUITE_LIMIT:-440} nox -s test-cuda) > $OUT/test-cuda.log 2>&1
tail -3 $OUT/test-cuda.log
(cd benchmarks/kernels && timeout $((585 - SECONDS)) python3 probe_vendor_fp8.py --out $OUT/vendor-fp8.json \
  ${PROBE_ARGS:-} > $OUT/vendor-fp8.log 2>&1)
cat $OUT/vendor-fp8.log | tail -40
ls $OUT
