#!/usr/bin/env bash
# Sourced at the start of every GPU-machine command: installs the carried wheels (nox and its needs) offline.
set -e
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# The device's copy of .git can be stale: write `git rev-parse HEAD > .carry/COMMIT` here before each call.
if [ -f .carry/COMMIT ]; then export ELASTISERVE_SOURCE_COMMIT=$(cat .carry/COMMIT); fi
mkdir -p "${OUT:-/tmp/out}"
export ELASTISERVE_TRACE_DIR=$PWD/.carry/traces

# The packages into the machine's Python (offline, editable) for scripts run outside nox.
install_packages() {
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e packages/platforms -e packages/memory \
    -e packages/kernels -e packages/control -e packages/engine >/dev/null 2>&1
}

# The start of a round: our packages installed, and which GPUs and commit it ran on into $OUT/gpus.txt.
start_round() {
  install_packages
  nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
}

# headline.py's MoE setting since session 9 (400 requests at full Azure lengths, 60 s per point, one T_base,
# 2,048-token chunks, mixed-step graphs, the step-time budget): add --rate, --policies, --out and the rest.
moe_budget_args() {
  echo "--setting moe --requests 400 --max-duration 60 --t-base ${T_BASE:-0.02465} --no-progress" \
    "--max-num-batched-tokens 2048 --mixed-graphs --max-step-time ${MAX_STEP_TIME:-0.11}"
}

# `nox -s test-cuda` on GPU 0 within LIMIT seconds, timed, into $OUT/test-cuda.log; for rounds that run a benchmark
# on GPU 1 beside it.
test_cuda_on_gpu0() {  # LIMIT
  (time CUDA_VISIBLE_DEVICES=0 timeout "$1" nox -s test-cuda) > $OUT/test-cuda.log 2>&1
  tail -3 $OUT/test-cuda.log
}

# The MoE headline at full Azure lengths (Qwen3-30B-A3B shapes, 80 GB budget, Gamma CV 2, 400 requests, 4 / 8 / 12
# req/s, each point cut at 60 s, one T_base for every policy: T_BASE, 24.65 ms unless set) on GPU $1 within $2
# seconds, into $OUT/moe and $OUT/moe-gpu$1.log; the other arguments go to headline.py (--policies,
# --max-num-batched-tokens, ...).
moe_headline() {  # GPU LIMIT [headline.py arguments...]
  local gpu=$1 limit=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout $limit python3 benchmarks/serving/headline.py --setting moe --requests 400 \
    --rate 4 --rate 8 --rate 12 --max-duration 60 --t-base ${T_BASE:-0.02465} --no-progress --out $OUT/moe "$@" \
    > $OUT/moe-gpu$gpu.log 2>&1
}

# The MoE table of everything under $OUT/moe, into $OUT/moe-table.txt and the log.
moe_table() {
  python3 benchmarks/serving/headline.py --setting moe --out $OUT/moe --summarize > $OUT/moe-table.txt 2>&1
  cat $OUT/moe-table.txt
}

# The decode table (roofline, fast/full at batches 1-32, Llama-3.1-8B shapes) into $R/decode-NAME.{json,log}; prints
# the table. The other arguments go to bench_decode.py (routing overrides such as --fp8-min-rows).
decode_table() {  # NAME [bench_decode.py arguments...]
  timeout ${DECODE_LIMIT:-150} python3 benchmarks/engine/bench_decode.py --parts roofline fast_full \
    --batch 1 2 4 8 16 32 --kv-gib 12 --iters 30 --trials 5 --out $R/decode-$1.json "${@:2}" > $R/decode-$1.log 2>&1
  echo "== decode $1"; sed -n "/^(a)/,/^results/p" $R/decode-$1.log
}

# Fast and full mode at batches 64 and 128 (Llama-3.1-8B shapes) into $R/decode-large-NAME.{json,log}; prints the
# table, or the log's end when it failed. The other arguments go to bench_decode.py (--nest-lm-head, ...).
decode_large() {  # NAME [bench_decode.py arguments...]
  timeout ${DECODE_LIMIT:-120} python3 benchmarks/engine/bench_decode.py --parts fast_full --batch 64 128 --kv-gib 16 \
    --iters 20 --trials 3 --out $R/decode-large-$1.json "${@:2}" > $R/decode-large-$1.log 2>&1
  echo "== decode large $1"; sed -n "/^(b)/,/^results/p" $R/decode-large-$1.log; tail -2 $R/decode-large-$1.log
}
