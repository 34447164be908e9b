#!/usr/bin/env bash
# One device call on a one-GPU host (~4 min), written in session 34 (run in session 36): Nsight Compute on full mode's
# GEMMs (benchmarks/kernels/ncu_full_gemm.py) beside cuBLAS's fp16 GEMM on the same problems, to tell what the tall
# TMA tile's K loop waits on at 64-256 rows (0.53-0.88x cuBLAS, issue 3's largest miss): stall reasons, issue slots,
# tensor-pipe and DRAM throughput, registers and occupancy. The report is read as text here and again offline with
# benchmarks/kernels/ncu_report_metrics.py. Counting bytes offline, the tall tiles move 4.0-5.4 TB/s from L2 (token
# tiles re-read once per weight tile) where our fp8 GEMM reaches 7.6-8.4 TB/s: the stall reasons of the K loop
# (barrier waits on TMA, wgmma dependencies) are what to read first.
source ci/gpu/bootstrap.sh
set +e
start_round
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-not found}"
(cd benchmarks/kernels && timeout ${NCU_LIMIT:-240} $NCU --clock-control none --kernel-name regex:"gemm|nvjet|xmma" \
  --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --export $OUT/ncu-full-gemm --force-overwrite python3 ncu_full_gemm.py \
  > $OUT/ncu-full-gemm.log 2>&1)
$NCU --import $OUT/ncu-full-gemm.ncu-rep --page details > $OUT/ncu-full-gemm-details.txt 2>&1
grep -E "gemm|nvjet|xmma|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall|round [0-9]|==ERR|rror" \
  $OUT/ncu-full-gemm-details.txt | head -150
