#!/usr/bin/env bash
# One device call on a two-GPU host (~6 minutes): the dense headline in the ElasticKV paper's own regime, a
# closed-loop client at concurrency 38 (its Tab. 3 / App. C.6), full lengths (4096 prompt / 1024 output tokens) and
# the full 20 GB KV pool, static-fp16 on GPU 0 beside elastickv on GPU 1, 400 of the 600 requests (the simulator's
# P90 TTFT stops changing after ~400: the first wave's prefill queue dominates it below that). One T_base for both
# (``T_BASE``: static-fp16's own, measured at concurrency 64 in session 6's first call).
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
T_BASE=${T_BASE:-0.01177}
REQUESTS=${REQUESTS:-400}
dense() {  # GPU, policy
  CUDA_VISIBLE_DEVICES=$1 timeout 500 python3 benchmarks/serving/headline.py --setting dense --requests $REQUESTS \
    --concurrency 38 --max-duration 440 --t-base $T_BASE --policies $2 --no-progress --out $OUT/dense \
    > $OUT/dense-$2.log 2>&1
}
dense 0 static-fp16 &
sleep 5
dense 1 elastickv
wait
python3 benchmarks/serving/headline.py --setting dense --out $OUT/dense --summarize > $OUT/dense-table.txt 2>&1
cat $OUT/dense-table.txt
tar czf $OUT/dense.tgz -C $OUT dense dense-static-fp16.log dense-elastickv.log && rm -rf $OUT/dense
