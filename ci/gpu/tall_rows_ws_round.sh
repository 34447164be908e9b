#!/usr/bin/env bash
# One device call on a one-GPU host (~4 min), session 34, each result straight into $OUT:
# 1. The GEMM table of the four Llama-3.1-8B linears at 33-128 rows as shipped (33-64 rows: the pointer tiles;
#    65-128: the 128-row tall TMA tiles).
# 2. The same with the tall tiles from 33 rows (--full-tall-min-rows 33): at 96-128 rows they ran 32.1 / 22.7 /
#    102.4 / 64.7 us against the 64-row pointer tile's 38.2 / 22.5 / 123.6 / 67.3 us at 64 rows (session 34), and
#    TMA fills the missing rows with zeros.
# 3. The warp-specialized tall tiles' CUDA test (same bits as unspecialized), then (2) with them on
#    (--full-tall-warp-specialize).
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
(time timeout ${WS_TEST_LIMIT:-80} nox -s test-cuda -- tests/kernels/test_gemm_tma.py -k warp) \
  > $OUT/test-cuda-ws-s34.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-ws-s34.log | tail -6
gemm ws-from-33 --m 33 48 64 96 128 --full-tall-min-rows 33 --full-tall-warp-specialize
