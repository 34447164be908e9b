#!/usr/bin/env bash
# One device call on a one-GPU host (~7 min), written in session 28 without a GPU: lm_head nested
# (EngineConfig.nest_lm_head, --nest-lm-head; off by default). Llama-3.1-8B's lm_head reads 1.05 GB in fp16 at
# every decode step in both modes; nested, fast mode reads its 0.53 GB upper plane: ~120 us a step at the H200's
# 4.3 TB/s, where batch 2 is ~38 us short of 1.6x fast over full.
# 1. The nested head's tests on the GPU (planes, modes, a dps engine switching it with CUDA graphs).
# 2. lm_head alone in the GEMM table at 1-32 and 128 rows: cuBLAS fp16, full and fast mode.
# 3. The decode table (roofline, fast/full at 1-32, then 64 and 128) as committed and with --nest-lm-head. Turning the
#    option on by default is a quality choice (SmolLM2 on the CPU: fast-mode perplexity 9.925 -> 10.269, BENCHMARKS.md
#    quality section); the figures go to BENCHMARKS.md either way.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(time timeout 200 nox -s test-cuda -- tests/engine/test_nested_lm_head.py) > $OUT/test-cuda-lm-head.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda-lm-head.log | tail -8
timeout 150 python3 benchmarks/kernels/bench_nested_gemm.py --shapes llama3.1-8b.lm_head --m 1 2 4 8 16 32 128 --no-moe \
  --out $R/gemm-lm-head.json > $R/gemm-lm-head.log 2>&1
grep "M=" $R/gemm-lm-head.log
decode_table committed
decode_table nest-lm-head --nest-lm-head
# Full mode from 65 rows merges a nested weight into scratch, then cuBLAS (0.37-0.51x of cuBLAS alone at 65-256
# rows): a nested lm_head pays that at batches of 65+ in full mode. Time it at 64 and 128.
decode_large committed
decode_large nest-lm-head --nest-lm-head
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
