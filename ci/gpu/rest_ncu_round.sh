#!/usr/bin/env bash
# One device call on a one-GPU host (~5.5 min), session 32: the rest of `nox -s test-cuda` (control, engine, memory,
# platforms; last on the GPU at 612d4f4), then Nsight Compute on the decode attention launches at batch 64 x 4,096
# (benchmarks/kernels/ncu_attention.py): the native kernel beside path 3's all-BASE launches (1.50x native, target
# 1.7x), to tell whether the BASE launch waits on memory (bytes in flight, the block-table load before each tile) or
# on its per-token work (a 16-row query tile that GQA fills with 4 rows): occupancy, DRAM throughput, warp stalls,
# tensor-pipe and issue use. Session 32's run printed no metrics (--export keeps them from stdout; hence --import
# afterwards); benchmarks/kernels/ncu_report_metrics.py reads a report without ncu.
PART=rest SUITE_LIMIT=${SUITE_LIMIT:-250} bash ci/gpu/suite_part_round.sh
source ci/gpu/bootstrap.sh
set +e
R=$OUT/r; mkdir -p $R
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-not found}"
(cd benchmarks/kernels && timeout ${NCU_LIMIT:-200} $NCU --clock-control none --kernel-name regex:paged_attention_kernel \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --export $R/ncu-attention --force-overwrite python3 ncu_attention.py > $R/ncu-attention.log 2>&1)
$NCU --import $R/ncu-attention.ncu-rep --page details > $R/ncu-attention-details.txt 2>&1  # the report as text
grep -E "paged_attention_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|round [0-9]|==ERR|rror" \
  $R/ncu-attention-details.txt | head -120
cp $OUT/gpus.txt $R/; tar czf $OUT/results.tgz -C $OUT r && rm -rf $R
