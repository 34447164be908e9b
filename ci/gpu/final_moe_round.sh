#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes), session 7's last.
# GPU 1: MoE static-fp16 then dps at 4 / 8 / 12 req/s, the `moe_lengths_round.sh` setting with 2,048-token chunks
#   again (1,024 halved every policy's throughput), now with the probed grouped tiles (nested full 1,995 -> 1,154 us
#   per layer at a 2,048-token chunk) and the one-launch tile map; compare with session 6's `moe-full-lengths-run2`.
# GPU 0: `nox -s test-cuda` on the final tree; then dense elastickv at concurrency 64 (the `suite_dense_round.sh`
#   point: what a step with BASE pairs costs after the O(1) BASE bounds, for the simulator's base_step_s); then the
#   mixed-step profile of static-fp16 (benchmarks/engine/profile_mixed_step.py) with what time is left.
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
moe_headline 1 565 --max-num-batched-tokens 2048 --policies static-fp16 dps &
sleep 3
test_cuda_on_gpu0 420  # 330 s was not enough beside the MoE run (session 7)
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/serving/headline.py --setting dense --requests 200 \
  --concurrency 64 --max-duration 150 --policies elastickv --no-progress --out $OUT/dense > $OUT/dense-elastickv.log 2>&1
(cd benchmarks/engine && CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 profile_mixed_step.py \
  --model qwen3-30b-a3b --policies static-fp16 --gpu-memory-budget 80e9 --batch 64 --context 1024 \
  --chunk 512 1024 2048 --repeats 4 --out $OUT/mixed-step-profile.json > $OUT/mixed-step-profile.log 2>&1)
grep -v "^USDT\|profiler_st" $OUT/mixed-step-profile.log | tail -5
python3 benchmarks/serving/headline.py --setting dense --out $OUT/dense --summarize > $OUT/dense-table.txt 2>&1
python3 benchmarks/control/fit_kv_read.py $OUT/dense --target-runs benchmarks/serving/results/dense-full-run2 \
  benchmarks/serving/results/dense-paper-run1 > $OUT/kv-read-fit.txt 2>&1
cat $OUT/dense-table.txt; grep -i "base_read_fraction\|base_step\|demote_batch" $OUT/kv-read-fit.txt
wait
moe_table
# At most 8 files come back (session 7 lost the suite's log and both runs' JSON to a tenth file): pack the rest.
tar czf $OUT/runs.tgz -C $OUT moe moe-gpu1.log dense dense-elastickv.log mixed-step-profile.log \
  && rm -rf $OUT/moe $OUT/dense $OUT/moe-gpu1.log $OUT/dense-elastickv.log $OUT/mixed-step-profile.log
ls $OUT
