#!/usr/bin/env bash
# One device call on a one-GPU host (~7 minutes), session 18's first: the GEMM table's fp8-rows column (fast mode on
# rows a quantizing norm wrote) at 1-256 rows on the four Llama-3.1-8B linears; the engine's decode at batches 1-4
# plain and with fp8 from one quantized row (FP8_MIN_M_QUANTIZED_INPUT 1), side by side; then full mode's tall token
# tiles (probe_fp8_tiles.py --mode full, FULL_TALL_CANDIDATES) at 48-256 rows in what is left of 585 s.
source ci/gpu/bootstrap.sh
set +e
start_round
(cd benchmarks/kernels && timeout 150 python3 bench_nested_gemm.py --m 1 2 16 64 256 --no-moe --shapes \
  llama3.1-8b.qkv llama3.1-8b.o llama3.1-8b.gate_up llama3.1-8b.down --out $OUT/nested-gemm.json \
  > $OUT/nested-gemm.log 2>&1)
grep "M=" $OUT/nested-gemm.log | sed -e 's/  */ /g'
for rows in 2 1; do
  (cd benchmarks/engine && timeout 100 python3 bench_decode.py --model llama-3.1-8b --parts fast_full \
    --batch 1 2 4 --kv-gib 12 --trials 5 --iters 30 --fp8-min-rows-quantized $rows \
    --out $OUT/bench-decode-q$rows.json > $OUT/bench-decode-q$rows.log 2>&1)
  grep -v "^USDT" $OUT/bench-decode-q$rows.log | tail -5
done
(cd benchmarks/kernels && timeout $((585 - SECONDS)) python3 probe_fp8_tiles.py --mode full --m 48 64 96 128 192 256 \
  --out $OUT/full-tall-tiles.json > $OUT/full-tall-tiles.log 2>&1)
cat $OUT/full-tall-tiles.log | tail -30
ls $OUT
