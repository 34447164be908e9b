#!/usr/bin/env bash
# One device call on a one-GPU host (~6 min), session 33, most telling first, each result straight into $OUT (a
# call cut by its limit keeps what finished; 7 files):
# 1. The attention CUDA tests: BASE words unpacked two at a time by inline PTX (attention.UNPACK_BASE_PTX, off)
#    bit-equal to Triton's 16-bit ops; path 3's BASE launch with a warp a slice (BASE_LAUNCH_SLICES, off) at real
#    sizes.
# 2. bench_attention.py --sweep sliced at 64 x 4,096: as shipped, with the PTX unpack, then sliced (4 / 2 slices, KV
#    splits x1 / x2, a 168-register cap), each beside the native path. sm90 compile: the PTX unpack takes the BASE
#    loop from 535 to 439 instructions an iteration; the sliced loop has no cross-warp barrier, 19.6 warp-instructions
#    a token against 27.4, but 180-185 registers.
# 3. Full mode's TMA tall tiles at 65-256 rows (configs.FULL_SM90_TALL; on since this round): their CUDA tests, then
#    the GEMM table of the four Llama-3.1-8B linears at 64-256 rows.
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout ${ATTN_TEST_LIMIT:-120} nox -s test-cuda -- tests/kernels/test_attention_cuda.py -k \
  "ptx or base_launch or real_size_decode") > $OUT/test-cuda-attention-s33.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-attention-s33.log | tail -8
(cd benchmarks/kernels && timeout ${SLICED_LIMIT:-130} python3 bench_attention.py --sweep sliced \
  --out $OUT/attention-sliced-64x4096.json > $OUT/attention-sliced-64x4096.log 2>&1)
grep "^{" $OUT/attention-sliced-64x4096.log
(time timeout ${TALL_TEST_LIMIT:-150} nox -s test-cuda -- tests/kernels/test_gemm_tma.py tests/kernels/test_merge_planes.py \
  tests/kernels/test_nested_gemm.py -k "tma or merge or route or tall or op_matches") > $OUT/test-cuda-tall-s33.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-tall-s33.log | tail -8
(cd benchmarks/kernels && timeout ${GEMM_LIMIT:-90} python3 bench_nested_gemm.py --no-moe \
  --m 64 96 128 192 256 --shapes llama3.1-8b.qkv llama3.1-8b.o llama3.1-8b.gate_up llama3.1-8b.down \
  --out $OUT/gemm-tall-rows.json > $OUT/gemm-tall-rows.log 2>&1)
grep -iE "M=|full|shape" $OUT/gemm-tall-rows.log | head -30
