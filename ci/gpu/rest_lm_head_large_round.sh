#!/usr/bin/env bash
# One device call on a one-GPU host (~6.5 min), session 30: the rest of `nox -s test-cuda` (control, engine, memory,
# platforms; last on the GPU at 612d4f4), then what lm_head_round.sh's last part could not time: the decode step at
# batches 64 and 128 as committed and with --nest-lm-head (full mode from 65 rows merges a nested weight into
# scratch before cuBLAS, so a nested lm_head pays that there). Its first run failed on the benchmark's setup (the
# first requests finished their 8 tokens while the last prefilled; fixed in decode_setup.decode_inputs).
PART=rest SUITE_LIMIT=${SUITE_LIMIT:-250} bash ci/gpu/suite_part_round.sh
source ci/gpu/bootstrap.sh
set +e
R=$OUT/r; mkdir -p $R
decode_large committed
decode_large nest-lm-head --nest-lm-head
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
