#!/usr/bin/env bash
# One device call on a one-GPU host (~6 min), written in session 28 without a GPU: fast mode's fp8 GEMM with its
# tiles fetched by TMA (gemm_tma, GemmConfig.tma; no table row takes it yet). At 16-256 rows our pointer kernel
# (cp.async) ran 1.2-1.5x slower than cuBLAS's FP8 GEMM (session 16), so fast mode is 1.21-1.50x fp16 there against
# the 1.7x target, and cuBLAS FP8 itself reaches 1.71-1.77x.
# 1. The TMA kernel's GPU tests: the pointer kernel's bits at Llama sizes (fp8 and full mode, both nestings, split-K),
#    a replayed CUDA graph.
# 2. probe_fp8_tiles.py --tma: every fp8 tile with the pointer fetch and with TMA, side by side, against cuBLAS fp16,
#    _scaled_mm and the table's tile, on the four Llama-3.1-8B linears at 16-256 rows (the quantizer included, as the
#    probe times it). A TMA tile that wins takes its row in configs._FP8_SM90_ROWS (tma=True).
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(time timeout 150 nox -s test-cuda -- tests/kernels/test_gemm_tma.py) > $OUT/test-cuda-gemm-tma.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-gemm-tma.log | tail -8
(cd benchmarks/kernels && timeout 400 python3 probe_fp8_tiles.py --tma --m 16 64 256 32 128 \
  --out $R/fp8-tma-tiles.json > $R/fp8-tma-tiles.log 2>&1)
grep "M=" $R/fp8-tma-tiles.log
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
