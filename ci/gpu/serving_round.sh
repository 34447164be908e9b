#!/usr/bin/env bash
# One device call after the kernel round: engine decode benchmarks, then the reduced headline runs, every result
# under $OUT (at most 8 files come back: each run's folder is packed into one tarball). Carry .whl and .carry
# (.carry/traces = a copy of ../shared/traces). Budget: ~9 minutes.
source ci/gpu/bootstrap.sh
set +e
install_packages
timeout 150 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b --parts roofline fast_full switch \
  --batch 1 4 16 32 64 --kv-gib 12 --trials 5 --iters 30 --out $OUT/bench_decode.json > $OUT/bench_decode.log 2>&1
tail -12 $OUT/bench_decode.log
timeout 200 python3 benchmarks/engine/bench_decode.py --model llama-3.1-8b --parts throughput --requests 300 \
  --throughput-kv-gib 16 --out $OUT/throughput.json > $OUT/throughput.log 2>&1
tail -8 $OUT/throughput.log
timeout 200 python3 benchmarks/serving/headline.py --setting dense --scale 0.25 --requests 96 --concurrency 48 \
  --max-num-seqs 48 --no-progress --out $OUT/dense > $OUT/dense.log 2>&1
tail -8 $OUT/dense.log
tar czf $OUT/dense.tgz -C $OUT dense dense.log && rm -rf $OUT/dense $OUT/dense.log
