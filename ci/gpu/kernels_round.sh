#!/usr/bin/env bash
# One device call: kernel tests at real sizes, the tile/decode probe, then the kernel benchmarks, logs and JSON under
# $OUT. About 9-10 minutes on an H200: give it the whole 600 s call.
source ci/gpu/bootstrap.sh
set +e
install_packages
python3 -m pytest --device=cuda -q tests/kernels -p no:cacheprovider --timeout 300 2>&1 | tee $OUT/kernel_tests.log | tail -30
timeout 120 python3 benchmarks/kernels/probe_gemm_configs.py --shapes qkv down --out $OUT/probe.json 2>&1 | tee $OUT/probe.log | tail -40
timeout 200 python3 benchmarks/kernels/bench_nested_gemm.py --out $OUT/bench_nested_gemm.json 2>&1 | tee $OUT/bench_nested_gemm.log | tail -45
timeout 100 python3 benchmarks/kernels/bench_attention.py --out $OUT/bench_attention.json 2>&1 | tee $OUT/bench_attention.log | tail -25
