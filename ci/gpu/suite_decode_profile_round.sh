#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 minutes), for session 19: `nox -s test-cuda` on the final tree (388 tests
# took 7 min 19 s at 687eac2; limit SUITE_LIMIT, 480 s), then the per-kernel profile of a decode step in full and
# fast mode (benchmarks/engine/profile_decode_kernels.py, batches 1 and 4) in what is left of 585 s, without and with
# PDL: where fast mode's batch-1 step goes (1.43x full, target 1.6x).
source ci/gpu/bootstrap.sh
set +e
start_round
(time timeout ${SUITE_LIMIT:-480} nox -s test-cuda) > $OUT/test-cuda.log 2>&1
grep -E "passed|failed|FAILED|Error" $OUT/test-cuda.log | tail -12
(cd benchmarks/engine && timeout $((585 - SECONDS)) python3 profile_decode_kernels.py --model llama-3.1-8b \
  --batch 1 4 --kv-gib 12 --out $OUT/decode-kernels.json > $OUT/decode-kernels.log 2>&1)
grep -v "^USDT" $OUT/decode-kernels.log | tail -60

# What is left: the same profile with every Triton kernel launched programmatically dependent (kernels/launch.py).
(cd benchmarks/engine && ELASTISERVE_PDL=on timeout $((590 - SECONDS)) python3 profile_decode_kernels.py \
  --model llama-3.1-8b --batch 1 4 --kv-gib 12 --out $OUT/decode-kernels-pdl.json > $OUT/decode-kernels-pdl.log 2>&1)
grep -v "^USDT" $OUT/decode-kernels-pdl.log | tail -40
ls $OUT
