#!/usr/bin/env bash
# One device call on a one-GPU host (~5 min), written in session 36: the decode step at batches 64 and 128 (full mode's
# GEMMs at 64-128 rows, where session 36's shared-B tiles now run gate_up, down and o) as committed, then with the
# routing before them (2c09abd's configs.py from .carry/old, swapped into the editable install).
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
DECODE_LIMIT=${DECODE_LIMIT:-140} decode_large committed
cp packages/kernels/src/elastiserve/kernels/configs.py /tmp/configs-committed.py
cp .carry/old/configs.py packages/kernels/src/elastiserve/kernels/configs.py
DECODE_LIMIT=${DECODE_LIMIT:-140} decode_large routing-2c09abd
cp /tmp/configs-committed.py packages/kernels/src/elastiserve/kernels/configs.py
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
