#!/usr/bin/env bash
# One device call on a one-GPU host (~3.5 min), session 23: l2_prefetch_round.sh again after the prefetch's pieces
# grew to MIN_PIECE (call 2 asked for 16-64-byte pieces, one per thread, and every mode got slower).
# The decode table with the prefetch off, at an eighth and at half the L2 (session 23's default), every
# mode, side by side. The flag became per mode in session 24.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
decode_table prefetch-off --l2-prefetch
decode_table prefetch-eighth --l2-prefetch full=0.125 weight_only=0.125 fp8=0.125 plain=0.125
decode_table prefetch-half --l2-prefetch full=0.5 weight_only=0.5 fp8=0.5 plain=0.5
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
