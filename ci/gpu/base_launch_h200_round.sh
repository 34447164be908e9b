#!/usr/bin/env bash
# One device call on a one-GPU host (~7 min), written in session 33 for an H200 (where all-BASE ran 1.50x native
# in session 30 against 1.87x on session 33's H100: the H200's 1.4x bandwidth leaves path 3's BASE launch short of
# issue slots, ncu on the H100 in session 32). Each result straight into $OUT (9 files):
# 1. bench_attention.py --sweep sliced at 64 x 4,096, whose first table is issue 3's attention ratios as committed on
#    the GPU; then the sweep: as shipped, the PTX unpack, the sliced BASE launch (4 / 2 slices, splits x1 / x2,
#    a 168-register cap). On the H100 none beat the shipped launch (194.1 us; PTX unpack 201.4, 2 slices 195.3).
# 2. --sweep unpack at 64 x 4,096: the PTX unpack on every BASE path (1, 2 and 3), which UNPACK_BASE_PTX switches.
# 3. --sweep base-launch at 64 x 4,096 and at 4 x 1,024 in 8,192-token tables (KV splits x1-x4, registers 96 / 80).
source ci/gpu/bootstrap.sh
set +e
start_round
(cd benchmarks/kernels && timeout ${SLICED_LIMIT:-150} python3 bench_attention.py --sweep sliced \
  --out $OUT/attention-sliced-64x4096.json > $OUT/attention-sliced-64x4096.log 2>&1)
grep -v "^\s*$" $OUT/attention-sliced-64x4096.log | tail -26
(cd benchmarks/kernels && timeout ${UNPACK_LIMIT:-80} python3 bench_attention.py --sweep unpack \
  --out $OUT/attention-unpack-64x4096.json > $OUT/attention-unpack-64x4096.log 2>&1)
grep "^{" $OUT/attention-unpack-64x4096.log
(cd benchmarks/kernels && timeout ${SWEEP_LIMIT:-150} python3 bench_attention.py --sweep base-launch \
  --out $OUT/attention-base-launch-64x4096.json > $OUT/attention-base-launch-64x4096.log 2>&1)
grep "^{" $OUT/attention-base-launch-64x4096.log
(cd benchmarks/kernels && timeout ${SHORT_LIMIT:-60} python3 bench_attention.py --sweep base-launch --batch 4 \
  --context 1024 --table-tokens 8192 --out $OUT/attention-base-launch-4x1024.json \
  > $OUT/attention-base-launch-4x1024.log 2>&1)
grep "^{" $OUT/attention-base-launch-4x1024.log
