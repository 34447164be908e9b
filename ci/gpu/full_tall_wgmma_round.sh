#!/usr/bin/env bash
# One device call on a one-GPU host (~8 min), written in session 28 without a GPU: full mode at 65-256 rows runs the
# materialized path (0.37-0.51x cuBLAS). Session 18's tall token tiles had 16-32 weight rows (mma.sync); the tiles
# of FULL_WGMMA_TALL_CANDIDATES have 64-128 weight rows, so the decoded tile feeds wgmma as register operand A (checked
# in the sm90 PTX on the CPU) and a 128-256-row token tile decodes each weight once. Probe them, with session 18's
# tall tiles beside them, against cuBLAS fp16 and the materialized path at 96-256 rows on the four Llama-3.1-8B
# linears, each also with its tiles fetched by TMA (gemm_tma: no address arithmetic in the loop, 109-174 registers
# against the pointer kernel's 135-254 at these tiles, compiled for sm90 on the CPU). A tile that beats the
# materialized path becomes full mode's row (configs.MATERIALIZE_MIN_M moves up). PROBE_LIMIT (default 540 s) cuts
# the probe where less of the call is left; its rows are logged as they come.
source ci/gpu/bootstrap.sh
set +e
start_round
R=$OUT/r; mkdir -p $R
(cd benchmarks/kernels && timeout ${PROBE_LIMIT:-540} python3 probe_fp8_tiles.py --mode full --tall-only --tma --m 128 256 96 192 \
  --out $R/full-tall-wgmma.json > $R/full-tall-wgmma.log 2>&1)
grep "M=" $R/full-tall-wgmma.log
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
