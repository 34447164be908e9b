"""Programmatic dependent launch, compiled for sm90 on the CPU (benchmarks/kernels/compile_report.py; Triton's own
ptxas, no GPU): with ``PDL`` a kernel's PTX waits for the previous grid (``griddepcontrol.wait``) before its first
global load or store and lets the next grid launch; without ``PDL`` neither is emitted. Bit-equality on the GPU:
tests/engine/test_programmatic_launch_cuda.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu]

COMPILE_REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "compile_report.py"
_COMPILE = """
import importlib, importlib.util, json, re, sys
spec = importlib.util.spec_from_file_location("compile_report", sys.argv[1])
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)
from elastiserve.kernels import skinny_gemm
rms_norm = importlib.import_module("elastiserve.kernels.rms_norm")
from elastiserve.kernels.skinny_configs import SkinnyConfig

def order(ptx):
    body = ptx[ptx.index(".entry"):]
    first = lambda pattern: min((m.start() for m in re.finditer(pattern, body)), default=-1)
    prefetches = [m.start() for m in re.finditer(r"cp\\.async\\.bulk\\.prefetch\\.L2", body)]
    return {"wait": first(r"griddepcontrol\\.wait"), "launch": first(r"griddepcontrol\\.launch_dependents"),
            "memory": first(r"\\b(ld|st)\\.global"), "prefetches": prefetches}

out = {}
fn = skinny_gemm._skinny_gemm_kernel
types = {n: "i32" for n in fn.arg_names}
types.update({"x_ptr": "*fp16", "w_ptr": "*u8", "lower_ptr": "*u8", "bias_ptr": "*fp16", "out_ptr": "*fp16",
              "w_scale": "fp32"})
base = {"stride_xk": 1, "stride_wk": 1, "stride_lk": 1, "stride_on": 1, "NESTING": 1, "HAS_BIAS": True,
        "PARTIAL": False, "EVEN_K": True, "PTX_DECODE": False, "DEFER": True, "M_PAD": 1, "BLOCK_N": 16,
        "BLOCK_K": 256, "VEC": 16}
for name, mode, pdl, prefetch in (("skinny_full_pdl", 0, True, 0), ("skinny_weight_only_pdl", 1, True, 0),
                                  ("skinny_full", 0, False, 0), ("skinny_full_pdl_prefetch", 0, True, 1024),
                                  ("skinny_weight_only_pdl_prefetch", 1, True, 1024)):
    const = dict(base, MODE=mode, PDL=pdl, PREFETCH_ROW_BYTES=prefetch, PREFETCH_CHUNKS=8,
                 PREFETCH_THREADS=128)
    out[name] = order(report.compile_kernel(fn, types, const, 4, 2, 90).asm["ptx"])
fn = rms_norm._rms_norm_kernel
types = {n: "i32" for n in fn.arg_names}
types.update({n: "*fp16" for n in ("out_ptr", "residual_out_ptr", "x_ptr", "residual_ptr", "weight_ptr")})
types.update({"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "eps": "fp32"})
const = {"HAS_RESIDUAL": True, "QUANT": True, "FP8_MAX": 448.0, "MIN_NORMAL": 2.0 ** -6, "ROUND_IN_SOFTWARE": False,
         "BLOCK": 4096, "PDL": True}
out["rms_norm_quant_pdl"] = order(report.compile_kernel(fn, types, const, 16, 1, 90).asm["ptx"])
from elastiserve.kernels import rotary
fn = rotary._rotary_kv_write_kernel
types = {n: "i32" for n in fn.arg_names}
types.update({n: "*fp16" for n in ("q_out_ptr", "kv_ptr", "q_ptr", "k_ptr", "v_ptr")})
types.update({"positions_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"})
const = {"BLOCK_SIZE": 16, "BLOCK_HQ": 16, "BLOCK_HKV": 8, "BLOCK_HALF": 64, "PDL": True}
out["rotary_kv_write_pdl"] = order(report.compile_kernel(fn, types, const, 4, 1, 90).asm["ptx"])
from elastiserve.kernels import fp8_activations
fn = fp8_activations._chunk_max_kernel
types = {n: "i32" for n in fn.arg_names}
types.update({"chunk_max_ptr": "*fp32", "x_ptr": "*fp16"})
out["quant_chunk_max_pdl"] = order(report.compile_kernel(fn, types, {"BLOCK": 1024, "PDL": True}, 4, 1, 90).asm["ptx"])
fn = fp8_activations._quantize_chunk_kernel
types = {n: "i32" for n in fn.arg_names}
types.update({"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "x_ptr": "*fp16", "chunk_max_ptr": "*fp32"})
const = {"FP8_MAX": 448.0, "MIN_NORMAL": 2.0 ** -6, "ROUND_IN_SOFTWARE": False, "BLOCK": 1024, "CHUNKS": 16,
         "PDL": True}
out["quant_chunk_codes_pdl"] = order(report.compile_kernel(fn, types, const, 4, 1, 90).asm["ptx"])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def found():
    """Every kernel of _COMPILE compiled for sm90 in one subprocess (the interpreter's env var removed)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(COMPILE_REPORT)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_pdl_kernels_wait_before_touching_memory(found):
    for name in ("skinny_full_pdl", "skinny_weight_only_pdl", "rms_norm_quant_pdl", "rotary_kv_write_pdl",
                 "quant_chunk_max_pdl", "quant_chunk_codes_pdl"):
        at = found[name]
        assert 0 <= at["wait"] < at["memory"] and at["launch"] > at["wait"], (name, at)
    assert found["skinny_full"]["wait"] == found["skinny_full"]["launch"] == -1
    assert found["skinny_full"]["memory"] >= 0
    assert found["skinny_full_pdl"]["prefetches"] == []


def test_weight_prefetch_is_issued_before_the_wait(found):
    """l2_prefetch.py: a GEMM asks the L2 for its weight rows before it waits on the previous grid (both planes in
    full mode, the upper one in weight-only mode), and still touches no memory before the wait."""
    for name, planes in (("skinny_full_pdl_prefetch", 2), ("skinny_weight_only_pdl_prefetch", 1)):
        at = found[name]
        assert len(at["prefetches"]) == planes and max(at["prefetches"]) < at["wait"] < at["memory"], (name, at)
