#!/usr/bin/env bash
# One device call on a two-GPU host: the dense headline at full lengths and the full 20 GB KV pool (Llama-3.1-8B
# shapes, 4096 prompt / 1024 output tokens), static-fp16 on GPU 0 beside elastickv on GPU 1, one closed-loop
# concurrency. Defaults (sessions 5 and 6, ~4-8 minutes): concurrency 64, 200 of the 600 requests, each point cut at
# 400 s. ``T_BASE`` (seconds) passes one T_base to both; unset, each engine measures its own.
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
CONCURRENCY=${CONCURRENCY:-64} REQUESTS=${REQUESTS:-200} MAX_DURATION=${MAX_DURATION:-400}
dense() {  # GPU, policy
  CUDA_VISIBLE_DEVICES=$1 timeout $((MAX_DURATION + 70)) python3 benchmarks/serving/headline.py --setting dense \
    --requests $REQUESTS --concurrency $CONCURRENCY --max-duration $MAX_DURATION ${T_BASE:+--t-base $T_BASE} \
    --policies $2 --no-progress --out $OUT/dense > $OUT/dense-$2.log 2>&1
}
dense 0 static-fp16 &
sleep 5
dense 1 elastickv
wait
python3 benchmarks/serving/headline.py --setting dense --out $OUT/dense --summarize > $OUT/dense-table.txt 2>&1
cat $OUT/dense-table.txt
tar czf $OUT/dense.tgz -C $OUT dense dense-static-fp16.log dense-elastickv.log && rm -rf $OUT/dense
