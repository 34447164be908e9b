#!/usr/bin/env bash
# One device call on a one-GPU host (~9.5 minutes), session 9: the MoE CUDA tests of the padding mask built once
# per step (it had cost ten launches per layer, 480 kernels a step), then the MoE headline (2,048-token chunks,
# --mixed-graphs) for static-fp16 and dps with the step-time token budget (--max-step-time 0.11, under the joint
# SLO's 5 x 24.65 ms) at 8 / 12 / 16 req/s (RATES), to find where static-fp16 stops meeting the SLO: at 4 / 8 req/s
# (session 8, run 2, no budget) it met it for 94.7 / 100 % of requests and dps for 53.3 / 63.5 %.
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
timeout 150 python3 -m pytest -q --device=cuda -p no:cacheprovider tests/engine/test_moe_cuda.py \
  tests/engine/test_moe_padding.py tests/engine/test_mixed_graphs_cuda.py \
  tests/memory/test_fast_mode_unmapped_lower_cuda.py > $OUT/moe-tests.log 2>&1
tail -2 $OUT/moe-tests.log
rates=""; for r in ${RATES:-8 12 16}; do rates="$rates --rate $r"; done
timeout $((585 - SECONDS)) python3 benchmarks/serving/headline.py --setting moe --requests 400 $rates \
  --max-duration 60 --t-base ${T_BASE:-0.02465} --no-progress --out $OUT/moe --max-num-batched-tokens 2048 \
  --mixed-graphs --max-step-time ${MAX_STEP_TIME:-0.11} --policies ${POLICIES:-static-fp16 dps} > $OUT/moe.log 2>&1
tail -3 $OUT/moe.log
moe_table
tar czf $OUT/runs.tgz -C $OUT moe moe.log && rm -rf $OUT/moe $OUT/moe.log
ls $OUT
