#!/usr/bin/env bash
# One device call on a one-GPU host (~3.5 min), session 23: l2_prefetch_round.sh again after the prefetch's pieces
# grew to MIN_PIECE (call 2 asked for 16-64-byte pieces, one per thread, and every mode got slower).
# The decode table with the prefetch off, at an eighth and at half the L2 (the default), side by side.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
decode_table prefetch-off --l2-prefetch-share 0
decode_table prefetch-eighth --l2-prefetch-share 0.125
decode_table prefetch-half
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
