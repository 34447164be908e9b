#!/usr/bin/env bash
# One device call on a one-GPU host (~7 min), written in session 43: where the exact-top head's time goes. Session
# 43 measured the head with the fused exact_rows kernel at +85 to +118 us (2.5-3.9 %) on the fast step over the FP8
# head at batches 1-32 (H100), no better than the torch ops before it, and with a chunked Triton top-k in place of
# torch.topk (3abd2a9, this round's first run) +80 to +143 us: no gain, not kept. That run's probe had 150 s and
# printed nothing (it compiled six top-k settings among the rest); it has 240 s now and no top-k settings.
# 1. The head's tests on the GPU (SKIP_TESTS=1 after a whole-suite call). 2. probe_exact_top.py: each step of
# exact_top_logits alone (torch.topk, exact_rows at 16 / 4 / 2 / 1 picked rows a program and K tiles of 256 /
# 1,024 / 4,096, the scatter, the whole step) at batches 1 / 8 / 32 and k = 16 / 64. 3. The decode table with
# --nest-lm-head and with --lm-head-exact-top 16, side by side. If another exact_rows launch wins in the probe, set
# exact_rows.BLOCK_T / BLOCK_K and rerun item 3.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
if [ -z "${SKIP_TESTS:-}" ]; then
  (time timeout ${TEST_LIMIT:-200} nox -s test-cuda -- tests/kernels/test_exact_rows.py \
    tests/kernels/test_nested_linear.py tests/kernels/test_nested_cuda_graph.py tests/engine/test_nested_lm_head.py) \
    > $OUT/test-cuda-exact-top.log 2>&1
  grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-exact-top.log | tail -8
fi
(timeout ${PROBE_LIMIT:-240} python3 benchmarks/kernels/probe_exact_top.py --out $R/probe-exact-top.json \
  > $R/probe-exact-top.log 2>&1)
tail -12 $R/probe-exact-top.log
decode_table nest-lm-head --nest-lm-head
decode_table exact-top-16 --nest-lm-head --lm-head-exact-top 16
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
