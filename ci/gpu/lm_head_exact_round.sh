#!/usr/bin/env bash
# One device call on a one-GPU host (~7 min), written in session 38 without a GPU: the nested head that keeps each
# row's N largest fast-mode logits exact (--lm-head-exact-top N, with --nest-lm-head; off by default). On SmolLM2
# (CPU) N = 16 keeps fast mode's top-1 agreement and greedy outputs with an FP8 head (BENCHMARKS.md, quality); its
# GPU cost is a top-k over the vocabulary, one elastiserve::exact_rows launch (N rows of both planes merged and
# dotted: Llama-3.1-8B 128 KB a row at N = 16) and a scatter, against the 0.53 GB the FP8 head saves a step (session
# 39, H100, with the gather / merge / dot still a dozen torch ops: 3.4-4.9 % of the fast step over the FP8 head).
# 1. The head's tests on the GPU (engine, op, CUDA graph). 2. The decode table (roofline, fast/full at batches 1-32)
# with --nest-lm-head, and with --nest-lm-head --lm-head-exact-top 16 and 64, side by side.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1 when the whole suite ran in the call before
  (time timeout 200 nox -s test-cuda -- tests/engine/test_nested_lm_head.py tests/kernels/test_nested_linear.py \
    tests/kernels/test_nested_cuda_graph.py) > $OUT/test-cuda-lm-head.log 2>&1
  grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-lm-head.log | tail -8
fi
decode_table nest-lm-head --nest-lm-head
decode_table exact-top-16 --nest-lm-head --lm-head-exact-top 16
decode_table exact-top-64 --nest-lm-head --lm-head-exact-top 64
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
