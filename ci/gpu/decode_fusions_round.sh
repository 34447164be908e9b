#!/usr/bin/env bash
# One device call on a one-GPU host (~7 min), session 21: the decode table (roofline, fast/full at batches 1-32)
# three ways side by side: this tree with the skinny GEMM's double-buffered weight loads (--skinny-prefetch 1),
# without them, and the f584d56 baseline (session 20's attention, rotary, engine and skinny files, carried in
# .carry/old: before the split merge moved into the attention launch and the rotary + KV-write fusion). Then the
# skinny probe at one row, both loops side by side (Llama-3.1-8B's four linears and lm_head), and the per-kernel
# profile of this tree at batch 1 with PDL off. Everything lands in one archive ($OUT/results.tgz). Ran at ebbc11a;
# bench_decode's --skinny-prefetch and the probe's --prefetch / --lm-head were removed after it (4a4eb33), so re-run
# it from a checkout of ebbc11a.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
bench() {  # NAME [bench_decode options]
  timeout 120 python3 benchmarks/engine/bench_decode.py --parts roofline fast_full --batch 1 2 4 8 16 32 \
    --kv-gib 12 --iters 30 --trials 5 --out $R/decode-$1.json "${@:2}" > $R/decode-$1.log 2>&1
  echo "== $1"; sed -n "/^(a)/,/^results/p" $R/decode-$1.log
}
bench prefetch --skinny-prefetch 1
bench in-place --skinny-prefetch 0
mkdir -p /tmp/new && for f in $(cd .carry/old && find . -type f); do mkdir -p /tmp/new/$(dirname $f); cp $f /tmp/new/$f; done
cp -r .carry/old/. .
bench baseline --skinny-prefetch 0
cp -r /tmp/new/. .
timeout $((500 - SECONDS)) python3 benchmarks/kernels/probe_skinny_gemm.py --m 1 --prefetch both --lm-head \
  --budget-s $((440 - SECONDS)) --out $R/skinny-probe.json > $R/skinny-probe.log 2>&1
sed -n '/^best skinny/,$p' $R/skinny-probe.log | grep -v "^$"
(cd benchmarks/engine && ELASTISERVE_PDL=off timeout $((575 - SECONDS)) python3 profile_decode_kernels.py \
  --model llama-3.1-8b --batch 1 --kv-gib 12 --out $R/decode-kernels-pdl-off.json > $R/decode-kernels-pdl-off.log 2>&1)
grep -v "^USDT" $R/decode-kernels-pdl-off.log | tail -30
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
