"""Nested FP16/FP8 GEMM and elastic attention kernels."""
