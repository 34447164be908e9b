#!/usr/bin/env bash
# One device call on a one-GPU host (~7 min), session 20: decode attention that merges only the KV splits holding
# pairs (and native-path splits of 2 pairs). The decode table (roofline, fast/full at batches 1-32) with the change
# and with the previous attention (the two files of fc89dd0, carried in .carry/old) side by side; the attention and
# engine GPU tests; the per-kernel profile at batches 1 and 2.
source ci/gpu/bootstrap.sh
set +e
start_round
kernels=packages/kernels/src/elastiserve/kernels
bench() {  # NAME
  timeout 150 python3 benchmarks/engine/bench_decode.py --parts roofline fast_full --batch 1 2 4 8 16 32 \
    --kv-gib 12 --iters 30 --trials 5 --out $OUT/decode-$1.json > $OUT/decode-$1.log 2>&1
  echo "== $1"; sed -n "/^(a)/,/^results/p" $OUT/decode-$1.log
}
bench used-splits
cp $kernels/attention.py /tmp/attention.py; cp $kernels/attention_kernels.py /tmp/attention_kernels.py
cp .carry/old/attention.py .carry/old/attention_kernels.py $kernels/
bench all-splits
cp /tmp/attention.py /tmp/attention_kernels.py $kernels/
(time timeout 240 nox -s test-cuda -- tests/kernels/test_attention.py tests/kernels/test_attention_cuda.py \
  tests/engine) > $OUT/test-cuda.log 2>&1
grep -E "passed|failed|FAILED|real" $OUT/test-cuda.log | tail -8
(cd benchmarks/engine && timeout $((585 - SECONDS)) python3 profile_decode_kernels.py --model llama-3.1-8b \
  --batch 1 2 --kv-gib 12 --out $OUT/decode-kernels.json > $OUT/decode-kernels.log 2>&1)
grep -v "^USDT" $OUT/decode-kernels.log | grep -E "^batch|attention" | tail -8
