#!/usr/bin/env bash
# One device call on a one-GPU host (~5 min), written in session 37, first run in session 39 on an H100 (sm90 then
# took the split at 2-256 rows): fast mode's activation quantizer with rows longer than 4,096 values split over
# 1,024-wide programs (fp8_activations.QUANT_SPLIT_ROWS). On the H200 the down GEMM at 256 rows ran 50.9 us in fast mode quantizing in the op against
# 34.8 us on rows quantized beforehand. First the quantizers' CUDA tests (every route bit-equal to the reference),
# then probe_quantizer.py (quantize_per_token at 16-4,096 rows and the quantizing SiLU-and-mul at 16-1,024, K = 12,288
# and 14,336, one program a row and split, side by side), then the GEMM table on the two down shapes as committed and with
# --quant-split-rows over the row range where the probe's split won. Adopt a range where it wins at every K.
source ci/gpu/bootstrap.sh
set +e
start_round
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1 when the whole suite ran in the call before
  (time timeout ${TEST_LIMIT:-150} nox -s test-cuda -- tests/kernels/test_nested_gemm.py tests/kernels/test_fp8_rows.py \
    -k "quantiz") > $OUT/test-quantizers.log 2>&1
  grep -E "passed|failed|FAILED|Error|real" $OUT/test-quantizers.log | tail -6
fi
(timeout ${PROBE_LIMIT:-150} python3 benchmarks/kernels/probe_quantizer.py --out $OUT/quantizer.json \
  > $OUT/quantizer.log 2>&1)
cat $OUT/quantizer.log | tail -40
for split in "" "--quant-split-rows ${SPLIT_LOW:-33} ${SPLIT_HIGH:-1024}"; do
  tag=$([ -z "$split" ] && echo committed || echo split)
  (timeout ${TABLE_LIMIT:-100} python3 benchmarks/kernels/bench_nested_gemm.py --no-moe \
    --shapes llama3.1-8b.down qwen3-8b.down --m 16 64 256 1024 4096 $split --out $OUT/gemm-down-$tag.json \
    > $OUT/gemm-down-$tag.log 2>&1)
  echo "== $tag"; grep -E "M=" $OUT/gemm-down-$tag.log | awk '{print $1, "M", $3, "fp16", $5, $11, $12, $13}'
done
