#!/usr/bin/env bash
# One device call on a one-GPU host (~1.5 min), session 34, each result straight into $OUT:
# 1. The GEMM table of the four Llama-3.1-8B linears at 33-128 rows as shipped.
# 2. The same at 33-64 rows with the tall tiles there on every weight class (--full-tall-min-rows 33). Session 34
#    ran both at adbec45 (when 33-64 rows took the pointer tiles on every class), which made qkv and gate_up take
#    the tall tiles from 33 rows (configs.FULL_TMA_MIN_M_BY_CLASS).
# Its third step at adbec45 timed a warp-specialized K loop for the 4-warp tall tiles (tl.range(warp_specialize=True),
# Triton 3.6): its CUDA test found wrong outputs (NaN) and it ran 1.6-2.0x slower on qkv, 1.1-1.2x on o and down at
# 64-128 rows, so that code was removed (BENCHMARKS.md, kernels, session 34).
source ci/gpu/bootstrap.sh
set +e
start_round
LLAMA="llama3.1-8b.qkv llama3.1-8b.o llama3.1-8b.gate_up llama3.1-8b.down"
gemm() {  # NAME [bench_nested_gemm.py arguments...]
  (cd benchmarks/kernels && timeout ${GEMM_LIMIT:-75} python3 bench_nested_gemm.py --no-moe --shapes $LLAMA \
    --out $OUT/gemm-$1.json "${@:2}" > $OUT/gemm-$1.log 2>&1)
  echo "== $1"; grep -E "M=" $OUT/gemm-$1.log | awk '{print $1, $3, "fp16", $5, "full", $9, $10}'
}
gemm shipped --m 33 48 64 96 128
gemm tall-from-33 --m 33 48 64 --full-tall-min-rows 33
