#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 min), session 33: session 32's tall tiles round with the BASE unpack.
# 1. Full mode at 65-256 rows on TMA tall tiles (configs.FULL_SM90_TALL, off until their GPU tests run:
#    FULL_SM90_TALL_ON): their CUDA tests and the GEMM table of the four Llama-3.1-8B linears at 64-256 rows with them
#    on (ours_full is the op's route; ours_full_kernel the fused kernel's table tile).
# 2. BASE words unpacked two at a time by inline PTX (attention.UNPACK_BASE_PTX; sm90 compile: the BASE launch's loop
#    535 -> 439 instructions, 104 -> 96 registers): the attention CUDA tests (bit-equal to Triton's 16-bit ops), then
#    bench_attention.py --sweep unpack at batch 64 x 4,096, both settings beside the native path.
# 3. Path 3's BASE launch with a warp a slice (attention.BASE_LAUNCH_SLICES, off: no barrier in its loop, 19.6 warp
#    instructions a token against 27.4, but 180-185 registers): bench_attention.py --sweep sliced at 64 x 4,096.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(time timeout ${TEST_LIMIT:-190} nox -s test-cuda -- tests/kernels/test_gemm_tma.py tests/kernels/test_merge_planes.py \
  tests/kernels/test_attention_cuda.py tests/kernels/test_attention.py tests/kernels/test_nested_gemm.py -k \
  "tma or merge or route or tall or attention or op_matches") > $OUT/test-cuda-s33.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-s33.log | tail -12
(cd benchmarks/kernels && timeout ${GEMM_LIMIT:-100} python3 bench_nested_gemm.py --no-moe --full-tall-tiles --m 64 96 128 192 256 \
  --shapes llama3.1-8b.qkv llama3.1-8b.o llama3.1-8b.gate_up llama3.1-8b.down --out $R/gemm-tall-rows.json \
  > $R/gemm-tall-rows.log 2>&1)
grep -iE "M=|full|shape" $R/gemm-tall-rows.log | head -40
(cd benchmarks/kernels && timeout ${UNPACK_LIMIT:-100} python3 bench_attention.py --sweep unpack \
  --out $R/attention-unpack-64x4096.json > $R/attention-unpack-64x4096.log 2>&1)
grep "^{" $R/attention-unpack-64x4096.log
(cd benchmarks/kernels && timeout ${SLICED_LIMIT:-130} python3 bench_attention.py --sweep sliced \
  --out $R/attention-sliced-64x4096.json > $R/attention-sliced-64x4096.log 2>&1)
grep -v "^\s*$" $R/attention-sliced-64x4096.log | tail -22
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
