#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes), written for the session after session 7.
# GPU 0: `nox -s test-cuda` on the final tree (session 7's last run of it hit its time limit; it includes
#   tests/engine/test_mixed_graphs_cuda.py, never run yet), then the static-fp16 mixed-step profile with
#   --mixed-graphs, to set beside benchmarks/engine/results/h200-mixed-step-profile-run1 (eager: 86-94 ms a step).
# GPU 1: the MoE headline (moe_lengths_round.sh's setting, 2,048-token chunks) for static-fp16 and dps with
#   --mixed-graphs, to set beside session 7's moe-full-lengths-run4 (eager mixed steps, same kernels).
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
moe_headline 1 570 --max-num-batched-tokens 2048 --mixed-graphs --policies static-fp16 dps &
sleep 3
test_cuda_on_gpu0 420
(cd benchmarks/engine && CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 profile_mixed_step.py \
  --model qwen3-30b-a3b --policies static-fp16 --gpu-memory-budget 80e9 --batch 64 --context 1024 \
  --chunk 512 1024 2048 --repeats 4 --mixed-graphs --out $OUT/mixed-step-profile.json \
  > $OUT/mixed-step-profile.log 2>&1)
grep -v "^USDT\|profiler_st" $OUT/mixed-step-profile.log | tail -4
wait
moe_table
# At most 8 files come back: gpus.txt, test-cuda.log, mixed-step-profile.json, moe-table.txt and this tarball.
tar czf $OUT/runs.tgz -C $OUT moe moe-gpu1.log mixed-step-profile.log \
  && rm -rf $OUT/moe $OUT/moe-gpu1.log $OUT/mixed-step-profile.log
ls $OUT
