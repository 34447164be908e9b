#!/usr/bin/env bash
# One device call on a two-GPU host (~9.5 minutes), session 7's last: `nox -s test-cuda` on the final tree (GPU 0),
# then combined at 8 and 12 req/s; beside it static-fp16 then dps at 4 / 8 / 12 req/s (GPU 1). The MoE headline
# setting of `moe_lengths_round.sh` with 2,048-token chunks again (1,024 halved every policy's throughput: eager
# mixed steps), now with the probed grouped tiles (nested full 1,995 -> 1,154 us per layer at a 2,048-token chunk)
# and the one-launch tile map. Compare with session 6's `moe-full-lengths-run2` (same settings, old kernels).
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
T_BASE=${T_BASE:-0.02465}
moe() {  # GPU, LIMIT, RATES, policies...
  local gpu=$1 limit=$2 rates=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout $limit python3 benchmarks/serving/headline.py --setting moe --requests 400 \
    $rates --max-duration 60 --max-num-batched-tokens 2048 --t-base $T_BASE \
    --policies "$@" --no-progress --out $OUT/moe > $OUT/moe-gpu$gpu.log 2>&1
}
moe 1 570 "--rate 4 --rate 8 --rate 12" static-fp16 dps &
sleep 3
test_cuda_on_gpu0 330
moe 0 $((570 - SECONDS)) "--rate 8 --rate 12" combined
wait
python3 benchmarks/serving/headline.py --setting moe --out $OUT/moe --summarize > $OUT/moe-table.txt 2>&1
cat $OUT/moe-table.txt
tar czf $OUT/moe.tgz -C $OUT moe moe-gpu0.log moe-gpu1.log && rm -rf $OUT/moe
