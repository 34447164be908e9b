#!/usr/bin/env bash
# One device call on a two-GPU host (~8 minutes): the dense headline at full lengths and the full 20 GB KV pool
# (Llama-3.1-8B shapes, 4096 prompt / 1024 output tokens), static-fp16 on GPU 0 beside elastickv on GPU 1, one
# closed-loop concurrency (64) and 200 of the 600 requests so both fit in one call; each point is cut at 400 s.
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
dense() {  # GPU, policy
  CUDA_VISIBLE_DEVICES=$1 timeout 470 python3 benchmarks/serving/headline.py --setting dense --requests 200 \
    --concurrency 64 --max-duration 400 --policies $2 --no-progress --out $OUT/dense > $OUT/dense-$2.log 2>&1
}
dense 0 static-fp16 &
sleep 5
dense 1 elastickv
wait
python3 benchmarks/serving/headline.py --setting dense --out $OUT/dense --summarize > $OUT/dense-table.txt 2>&1
cat $OUT/dense-table.txt
tar czf $OUT/dense.tgz -C $OUT dense dense-static-fp16.log dense-elastickv.log && rm -rf $OUT/dense
