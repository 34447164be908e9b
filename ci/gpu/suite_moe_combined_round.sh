#!/usr/bin/env bash
# One device call on a two-GPU host (~5.5 minutes), session 6's last: `nox -s test-cuda` on GPU 0 beside the MoE
# headline's combined policy on GPU 1 (full Azure lengths, rates 4 / 8 / 12, 60 s per point, 2,048-token chunks,
# session 5's T_base), after the sweep's settle fix; it completes the table whose static-fp16 and dps rows came
# from `moe_lengths_round.sh` in the same session.
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
(CUDA_VISIBLE_DEVICES=1 timeout 420 python3 benchmarks/serving/headline.py --setting moe --requests 400 --rate 4 \
  --rate 8 --rate 12 --max-duration 60 --max-num-batched-tokens 2048 --t-base 0.02465 --policies combined \
  --no-progress --out $OUT/moe > $OUT/moe-gpu1.log 2>&1) &
sleep 3
test_cuda_on_gpu0 430
wait
python3 benchmarks/serving/headline.py --setting moe --out $OUT/moe --summarize > $OUT/moe-table.txt 2>&1
cat $OUT/moe-table.txt
tar czf $OUT/moe.tgz -C $OUT moe moe-gpu1.log && rm -rf $OUT/moe
