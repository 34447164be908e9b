#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 minutes), session 16's third: the kernel CUDA tests with the new sm90 fp8
# rows and quantizer rule, the engine decode benchmark (batches 1-32), the kernel benchmark's whole GEMM table
# (bench_nested_gemm.py: Llama-3.1-8B and Qwen3-8B shapes x M 1-4096, and the MoE rows), then full mode's fused tiles
# below the materializing rows (probe_fp8_tiles.py --mode full) in what is left of 585 s.
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout 170 nox -s test-cuda -- tests/kernels) > $OUT/test-cuda-kernels.log 2>&1
tail -3 $OUT/test-cuda-kernels.log
(cd benchmarks/engine && timeout 120 python3 bench_decode.py --model llama-3.1-8b --parts roofline fast_full switch \
  --batch 1 4 16 32 --kv-gib 12 --trials 5 --iters 30 --out $OUT/bench-decode.json > $OUT/bench-decode.log 2>&1)
grep -v "^USDT" $OUT/bench-decode.log | tail -12
(cd benchmarks/kernels && timeout 250 python3 bench_nested_gemm.py --out $OUT/nested-gemm.json \
  > $OUT/nested-gemm.log 2>&1)
tail -12 $OUT/nested-gemm.log
[ $SECONDS -lt 540 ] && (cd benchmarks/kernels && timeout $((585 - SECONDS)) python3 probe_fp8_tiles.py --mode full \
  --out $OUT/full-tiles.json > $OUT/full-tiles.log 2>&1)
cat $OUT/full-tiles.log | tail -24
ls $OUT
