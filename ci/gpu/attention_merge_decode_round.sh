#!/usr/bin/env bash
# One device call on a one-GPU host (~2.5 min), session 21: the decode step with the split merge in the attention launch
# and with f584d56's attention (its two files, carried in .carry/old), side by side: the decode table (roofline,
# fast/full at batches 1-4, graphs captured for 8,192-token contexts, 512-token prompts), then the per-kernel
# profile at batch 1 of each.
source ci/gpu/bootstrap.sh
set +e
start_round
kernels=packages/kernels/src/elastiserve/kernels
bench() {  # NAME
  timeout 170 python3 benchmarks/engine/bench_decode.py --parts roofline fast_full --batch 1 2 4 --kv-gib 12 \
    --iters 30 --trials 5 --out $OUT/decode-$1.json > /tmp/decode-$1.log 2>&1
  echo "== $1"; sed -n "/^(a)/,/^results/p" /tmp/decode-$1.log
}
profile() {  # NAME
  (cd benchmarks/engine && timeout 75 python3 profile_decode_kernels.py --model llama-3.1-8b --batch 1 --kv-gib 12 \
    --out /tmp/decode-kernels-$1.json > /tmp/decode-kernels-$1.log 2>&1)
  echo "== $1"; grep -v "^USDT" /tmp/decode-kernels-$1.log | grep -E "^batch|attention|step" | tail -8
}
swap_in_old() {
  cp $kernels/attention.py /tmp/attention.py; cp $kernels/attention_kernels.py /tmp/attention_kernels.py
  cp .carry/old/attention.py .carry/old/attention_kernels.py $kernels/
}
restore_new() { cp /tmp/attention.py /tmp/attention_kernels.py $kernels/; }
{ bench merge; swap_in_old; bench reduce; restore_new; profile merge; swap_in_old; profile reduce; restore_new; } \
  > $OUT/decode.log 2>&1
cat $OUT/decode.log
tar czf $OUT/raw.tgz -C /tmp $(cd /tmp && ls decode-*.log decode-kernels-*.json 2>/dev/null)
