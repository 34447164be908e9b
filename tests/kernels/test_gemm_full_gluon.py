"""Full mode's Gluon GEMM (``gemm_full_gluon``, a probe kernel on sm90): close to the pure-torch reference at rows,
columns and K that no tile divides, split-K, both nestings; compiled for sm90 on the CPU it fetches by TMA, keeps one
wgmma in flight across K steps and spills nothing. Gluon has no interpreter: the CPU checks only its compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_gemm_tma import layer

from elastiserve.kernels import nested_gemm
from elastiserve.platforms import ConfigError

# (block_m, block_n, block_k, stages, warps, split_k); the warp-specialized kernel's warps are its MMA partition's
TILES = {False: [(128, 128, 64, 3, 8, 1), (128, 64, 64, 4, 4, 1), (64, 128, 64, 3, 4, 3), (256, 128, 64, 2, 8, 1)],
         True: [(128, 128, 64, 3, 4, 1), (64, 128, 64, 4, 4, 3), (256, 128, 64, 3, 8, 1), (128, 64, 64, 2, 4, 1)]}


def planes(device, n, k, seed, outlier=None):
    upper, lower, nesting, exp = layer(device, n, k, seed, outlier)  # the TMA tests' weights
    return upper, lower, int(nesting), exp


@pytest.mark.parametrize("warp_specialized", [False, True])
@pytest.mark.parametrize("outlier", [None, 5.0, -40.0])  # E4M3, E4M3 prescaled by 2^-2, E5M2
@pytest.mark.cuda
@pytest.mark.timeout(120, method="thread")  # a pipeline waiting on a barrier nobody arrives at hangs in C:
# the thread method ends the process instead of hanging the suite
def test_gluon_full_gemm_matches_the_reference(device, outlier, warp_specialized):
    from elastiserve.kernels.gemm_full_gluon import launch_full_gluon
    for m, n, k in ((1, 6144, 4096), (100, 6144, 4096), (300, 4000, 4160), (1000, 4096, 14336)):
        upper, lower, nesting, exp = planes(device, n, k, m + n, outlier)
        assert (nesting, exp) == {None: (1, 0), 5.0: (1, 2), -40.0: (2, 0)}[outlier]
        x = torch.randn(m, k, device=device).half()
        bias = torch.randn(n, device=device).half()
        ref = nested_gemm.nested_linear_ref(x, upper, lower, bias, nesting, "full", weight_exp=exp).float()
        for tile in TILES[warp_specialized]:
            bm, bn, bk, stages, warps, split = tile
            out = launch_full_gluon(x, upper, lower, nesting, bm, bn, bk, stages, warps, split, bias=bias,
                                    weight_exp=exp, warp_specialized=warp_specialized).float()
            err = float((out - ref).abs().max() / ref.abs().max())
            assert err < 2e-2, ((m, n, k), tile, err)


@pytest.mark.cuda
def test_gluon_full_gemm_rejects_what_it_cannot_run(device):
    from elastiserve.kernels.gemm_full_gluon import launch_full_gluon
    upper, lower, nesting, _ = planes(device, 128, 256, 1)
    x = torch.randn(8, 256, device=device).half()
    with pytest.raises(ConfigError, match="fp16 rows"):
        launch_full_gluon(x.float(), upper, lower, nesting, 64, 64)
    with pytest.raises(ConfigError, match="nesting"):
        launch_full_gluon(x, upper, lower, 3, 64, 64)
    with pytest.raises(ConfigError, match="unsupported tile"):
        launch_full_gluon(x, upper, lower, nesting, 32, 64)  # 4 warps need 64 token rows
    with pytest.raises(ConfigError, match="decode_regs"):
        launch_full_gluon(x, upper, lower, nesting, 64, 64, warp_specialized=True, decode_regs=100)


COMPILE_REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "compile_report.py"
_GLUON_PTX = """
import importlib.util, json, re, sys
spec = importlib.util.spec_from_file_location("compile_report", sys.argv[1])
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from elastiserve.kernels import gemm_full_gluon
warp_specialized = sys.argv[2] == "1"
fn = gemm_full_gluon._full_gluon_ws_kernel if warp_specialized else gemm_full_gluon._full_gluon_kernel
xl = gl.NVMMASharedLayout.get_default_for([128, 64], gl.float16)
pl = gl.NVMMASharedLayout.get_default_for([128, 64], gl.uint8)
types = {"x_desc": f"tensordesc<fp16[128, 64],{xl!r}>", "u_desc": f"tensordesc<u8[128, 64],{pl!r}>",
         "l_desc": f"tensordesc<u8[128, 64],{pl!r}>", "out_ptr": "*fp16", "bias_ptr": "*fp16", "w_scale": "fp32"}
const = {"NESTING": 1, "HAS_BIAS": True, "BM": 128, "BN": 128, "BK": 64, "STAGES": 3, "GROUP_M": 8, "SPLIT_K": 1,
         "num_warps": 4 if warp_specialized else 8}
if warp_specialized:
    const.update({"WBUF": 2, "DECODE_WARPS": 4, "DECODE_REGS": 168})
signature = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("out_ptr", "N", "k_per_split", "stride_om")}
src = GluonASTSource(fn=fn, signature=signature, constexprs=const, attrs=attrs)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": const["num_warps"]}).asm["ptx"]
count = lambda pattern: len(re.findall(pattern, ptx))
print(json.dumps({"bulk": count(r"cp\\.async\\.bulk\\.tensor"), "wgmma": count(r"wgmma\\.mma_async"),
                  "wait1": count(r"wgmma\\.wait_group\\.sync\\.aligned 1;"), "spills": report.ptxas_usage(ptx, 90)[1],
                  "setmaxnreg": count(r"setmaxnreg"), "named_barriers": count(r"bar\\.sync\\s+[1-9]")}))
"""


@pytest.mark.parametrize("warp_specialized", [False, True])
@pytest.mark.cpu
def test_compiled_for_sm90_it_keeps_one_wgmma_in_flight(warp_specialized):
    """On the CPU, Triton's own ptxas: bulk tensor copies, async wgmma waited down to one in flight, no spills; the
    producer / consumer kernel in partitions with their own register counts and their own named barriers."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _GLUON_PTX, str(COMPILE_REPORT), str(int(warp_specialized))],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["bulk"] >= 3 and found["wgmma"] > 0 and found["wait1"] == 1 and found["spills"] == 0, found
    assert (found["setmaxnreg"] > 0 and found["named_barriers"] > 0) == warp_specialized, found
