#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 min): offline throughput on 1,000 ShareGPT-length requests (Llama-3.1-8B
# shapes, random weights, a 16 GiB KV pool), every policy in one process one after another, so that their ratios are
# side by side on one tree and one GPU. Sessions 3-4 measured them in separate calls and trees (BENCHMARKS.md).
# static-fp16 first (the reference), static-fp8 last (the longest-known rows are cut first if time runs out).
# MODEL=qwen3-30b-a3b runs the MoE shapes instead (whose grouped-GEMM warm-up, f6f4533, the log's in-loop compile
# lines check). EXTRA: more bench_decode.py arguments (e.g. --queue-fast-after 0.5); NAME: the output files' stem.
source ci/gpu/bootstrap.sh
set +e
start_round
timeout ${LIMIT:-560} python3 benchmarks/engine/bench_decode.py --model ${MODEL:-llama-3.1-8b} --parts throughput \
  --requests 1000 --throughput-kv-gib 16 --policies ${POLICIES:-static-fp16 dps combined elastickv static-fp8} \
  ${EXTRA:-} --out $OUT/${NAME:-sharegpt-throughput}.json > $OUT/${NAME:-sharegpt-throughput}.log 2>&1
grep -h "^throughput" $OUT/${NAME:-sharegpt-throughput}.log; tail -4 $OUT/${NAME:-sharegpt-throughput}.log
ls $OUT
