#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes), session 7's last: `nox -s test-cuda` on the final tree, then the
# mixed-step profile (benchmarks/engine/profile_mixed_step.py: static-fp16 and dps, Qwen3-30B-A3B shapes, a decode
# batch of 64 plus one 512 / 1,024 / 2,048-token chunk) on GPU 0; beside them MoE static-fp16 then dps at 4 / 8 / 12
# req/s on GPU 1: the `moe_lengths_round.sh` setting with 2,048-token chunks again (1,024 halved every policy's
# throughput), now with the probed grouped tiles (nested full 1,995 -> 1,154 us per layer at a 2,048-token chunk)
# and the one-launch tile map. Compare with session 6's `moe-full-lengths-run2` (same settings, old kernels).
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
T_BASE=${T_BASE:-0.02465}
(CUDA_VISIBLE_DEVICES=1 timeout 570 python3 benchmarks/serving/headline.py --setting moe --requests 400 \
  --rate 4 --rate 8 --rate 12 --max-duration 60 --max-num-batched-tokens 2048 --t-base $T_BASE \
  --policies static-fp16 dps --no-progress --out $OUT/moe > $OUT/moe-gpu1.log 2>&1) &
sleep 3
test_cuda_on_gpu0 330
(cd benchmarks/engine && CUDA_VISIBLE_DEVICES=0 timeout $((560 - SECONDS)) python3 profile_mixed_step.py \
  --model qwen3-30b-a3b --policies static-fp16 dps --gpu-memory-budget 80e9 --batch 64 --context 1024 \
  --chunk 512 1024 2048 --out $OUT/mixed-step-profile.json > $OUT/mixed-step-profile.log 2>&1)
cat $OUT/mixed-step-profile.log | grep -v "^USDT\|profiler_st"
wait
python3 benchmarks/serving/headline.py --setting moe --out $OUT/moe --summarize > $OUT/moe-table.txt 2>&1
cat $OUT/moe-table.txt
tar czf $OUT/moe.tgz -C $OUT moe moe-gpu1.log && rm -rf $OUT/moe
