#!/usr/bin/env bash
# One device call on a one-GPU host (~8 minutes), session 19: does o_proj's fp8 GEMM gain by quantizing its fp16
# rows in its own prologue (nested_gemm.QUANTIZE_IN_GEMM_MAX_M) instead of after a quantizer launch? (1) The GEMM
# table's two new columns, quantizer launch vs in-GEMM, on the o shapes (and qkv for fp8 at one row) at 1-256 rows;
# (2) the decode step's fast/full at batches 1-32 four ways side by side: the tables as committed, in-GEMM
# quantization up to 64 rows, that with every Triton kernel launched programmatically dependent (ELASTISERVE_PDL=on,
# kernels/launch.py), and that with each GEMM asking the L2 for 8 MiB of its weights before it waits.
source ci/gpu/bootstrap.sh
set +e
start_round
timeout 150 python3 benchmarks/kernels/bench_nested_gemm.py --m 1 2 8 16 64 256 --no-moe \
  --shapes llama3.1-8b.o qwen3-8b.o --out $OUT/gemm-in-gemm.json > $OUT/gemm-in-gemm.log 2>&1
grep -v "^USDT" $OUT/gemm-in-gemm.log | tail -30
for variant in "tables:off:" "in-gemm-64:off:--quantize-in-gemm-max-rows 64" \
               "in-gemm-64-pdl:on:--quantize-in-gemm-max-rows 64" \
               "in-gemm-64-pdl-prefetch-8:on:--quantize-in-gemm-max-rows 64 --weight-prefetch-mib 8"; do
  name=${variant%%:*}; rest=${variant#*:}; pdl=${rest%%:*}; extra=${rest#*:}
  ELASTISERVE_PDL=$pdl timeout $((590 - SECONDS)) python3 benchmarks/engine/bench_decode.py --parts fast_full \
    --batch 1 2 4 8 16 32 --kv-gib 12 --iters 30 --trials 5 --out $OUT/decode-$name.json $extra > $OUT/decode-$name.log 2>&1
  echo "== $name"; sed -n "/^(b)/,/^results/p" $OUT/decode-$name.log
done
cd $OUT && tar czf logs.tgz *.log && ls
