#!/usr/bin/env bash
# One device call on a two-GPU host (~8 minutes), written for the session after session 6: `nox -s test-cuda` on
# GPU 0 (the final tree's CPU-only changes: the capture gate, the lazy demotion ranking, the exposure count, the
# warm-up's odd row counts) beside the dense headline's elastickv at full size, concurrency 64, on GPU 1. Compare
# elastickv's TPOT, wall time and demoting-step cost with session 6's `dense-full-run2` (34 ms, 130 s, +2.5 ms per
# demoting step at this concurrency) to see what the host-side changes bought; static-fp16 is unchanged by them.
# Then the grouped MoE tile probe (benchmarks/kernels/probe_moe_configs.py), plain and fp8 on GPU 0, nested full
# (portable and PTX decode) on GPU 1.
source ci/gpu/bootstrap.sh
set +e
install_packages
nvidia-smi -L > $OUT/gpus.txt 2>&1; echo "${ELASTISERVE_SOURCE_COMMIT:-unknown}" >> $OUT/gpus.txt
probe() {  # GPU, NAME, modes...
  local gpu=$1 name=$2; shift 2
  (cd benchmarks/kernels && CUDA_VISIBLE_DEVICES=$gpu timeout 200 python3 probe_moe_configs.py \
    --out $OUT/probe/moe-probe-$name.json --modes "$@" > $OUT/probe/moe-probe-$name.log 2>&1)
}
mkdir -p $OUT/probe
(CUDA_VISIBLE_DEVICES=1 timeout 300 python3 benchmarks/serving/headline.py --setting dense --requests 200 \
  --concurrency 64 --max-duration 250 --policies elastickv --no-progress --out $OUT/dense > $OUT/dense-elastickv.log 2>&1;
  probe 1 full full full_ptx) &
sleep 3
test_cuda_on_gpu0 330
probe 0 plain-fp8 plain fp8
wait
python3 benchmarks/serving/headline.py --setting dense --out $OUT/dense --summarize > $OUT/dense-table.txt 2>&1
cat $OUT/dense-table.txt
python3 benchmarks/control/fit_kv_read.py $OUT/dense > $OUT/kv-read-fit.txt 2>&1
tar czf $OUT/dense.tgz -C $OUT dense dense-elastickv.log && rm -rf $OUT/dense
tar czf $OUT/probe.tgz -C $OUT probe && rm -rf $OUT/probe
