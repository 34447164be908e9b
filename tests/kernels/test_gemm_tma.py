"""The nested GEMM with TMA tiles (``gemm_tma``, a ``GemmConfig`` with ``tma=True``), fast mode's fp8 rows and full
mode: the same bits as the pointer kernel at the same tile (both sum the same K tiles in the same order and share the
epilogue), rows, columns and K that no tile divides (the descriptors fill zeros), swap-AB or not, split-K merged or
reduced, a bias, both nestings, a prescaled layer; close to the pure-torch reference; inside a CUDA graph; compiled
for sm90 it fetches by ``cp.async.bulk.tensor`` and multiplies by wgmma. What cannot run raises ``ConfigError``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from elastiserve.kernels import configs, formats, nested_gemm
from elastiserve.kernels.configs import GemmConfig
from elastiserve.kernels.fp8_activations import quantize_per_token
from elastiserve.platforms import ConfigError

TILES = [GemmConfig(16, 32, 32), GemmConfig(32, 16, 64, swap_ab=False), GemmConfig(16, 32, 32, split_k=2)]
GPU_TILES = [GemmConfig(16, 64, 128, num_stages=4), GemmConfig(64, 128, 128, num_stages=4, swap_ab=False),
             GemmConfig(16, 128, 128, num_stages=4, split_k=4), GemmConfig(128, 256, 128, num_warps=8, swap_ab=False)]
# Full mode on the GPU: the sm90 decode tile, it split, and every tile of full mode's TMA table at 33-256 rows
# (configs.FULL_SM90_TMA: register-A tall tiles and, since session 36, shared-B tiles; swap-AB or not).
TMA_TABLE_TILES = dict.fromkeys(replace(c, tma=False) for row in configs.FULL_SM90_TMA.values() for c in row.values())
GPU_FULL_TILES = [GemmConfig(16, 32, 256, num_stages=4, ptx_decode=True),
                  GemmConfig(16, 32, 256, num_stages=4, ptx_decode=True, split_k=4), *TMA_TABLE_TILES]


def layer(device, n, k, seed, outlier=None):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.3).half()
    if outlier is not None:
        w[w.abs() < 2.0**-10] = 0.0  # so a 2^-2 prescale stays exact
        w[1, 2] = outlier
    nesting, exp, _ = formats.choose_nesting(w)
    upper, lower = formats.split(w, nesting, exp)
    return upper.to(device), lower.to(device), nesting, exp


def both_kernels(x, upper, lower, bias, nesting, exp, config, mode="fp8"):
    q, scale = quantize_per_token(x) if mode == "fp8" else (x, None)
    run = lambda cfg: nested_gemm.nested_gemm(q, upper, lower, bias, nesting, mode, weight_exp=exp, config=cfg,  # noqa: E731
                                              x_scale=scale)
    return run(config), run(replace(config, tma=True)), (q, scale)


def shapes_and_tiles(device, mode):
    if device.type == "cpu":  # the interpreter: small and odd
        return [((5, 48, 96), TILES), ((33, 80, 160), TILES)]
    tiles = GPU_TILES if mode == "fp8" else GPU_FULL_TILES
    return [((m, 6144, 4096), tiles) for m in (16, 100, 256)] + [((64, 4096, 14336), tiles)]


@pytest.mark.parametrize("mode", ["fp8", "full"])
@pytest.mark.parametrize("outlier", [None, 5.0, -40.0])  # E4M3, E4M3 prescaled by 2^-2, E5M2
@pytest.mark.cpu
@pytest.mark.cuda
def test_tma_tiles_give_the_pointer_kernels_bits(device, outlier, mode):
    for (m, n, k), tiles in shapes_and_tiles(device, mode):
        upper, lower, nesting, exp = layer(device, n, k, m + n, outlier)
        assert (nesting, exp) == {None: (1, 0), 5.0: (1, 2), -40.0: (2, 0)}[outlier]
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(m, k, generator=gen).half().to(device)
        bias = torch.randn(n, generator=gen).half().to(device)
        for config in tiles:
            pointer, tma, (q, scale) = both_kernels(x, upper, lower, bias, nesting, exp, config, mode)
            assert torch.equal(tma.view(torch.int16), pointer.view(torch.int16)), (m, n, k, config)
            if mode == "fp8":
                ref = nested_gemm.nested_linear_fp8_ref(q, scale, upper, lower, bias, int(nesting), weight_exp=exp)
            else:  # the exact weight: fp16 GEMM tolerance
                ref = nested_gemm.nested_linear_ref(x, upper, lower, bias, int(nesting), "full", weight_exp=exp)
            torch.testing.assert_close(tma.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.cuda
def test_tma_tiles_replay_in_a_cuda_graph(device):
    upper, lower, nesting, _ = layer(device, 6144, 4096, 1)
    x = torch.randn(32, 4096, device=device).half()
    config = replace(GPU_TILES[0], tma=True)
    q, scale = quantize_per_token(x)
    call = lambda: nested_gemm.nested_gemm(q, upper, lower, None, nesting, "fp8", config=config, x_scale=scale)  # noqa: E731
    expected = call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    q.copy_(quantize_per_token(x * 2)[0])  # new rows in the captured buffers
    scale.copy_(quantize_per_token(x * 2)[1])
    graph.replay()
    assert torch.equal(out, call()) and not torch.equal(out, expected)


@pytest.mark.cpu
@pytest.mark.cuda
def test_what_tma_cannot_run_raises(device):
    upper, lower, nesting, _ = layer(device, 48, 96, 3)
    x = torch.randn(5, 96).half().to(device)
    q, scale = quantize_per_token(x)
    with pytest.raises(ConfigError, match="full and OCP fp8 mode"):
        nested_gemm.nested_gemm(x, upper, lower, None, nesting, "weight_only", config=GemmConfig(16, 32, 32, tma=True))
    with pytest.raises(ConfigError, match="at most 256"):
        nested_gemm.nested_gemm(q, upper, lower, None, nesting, "fp8", config=GemmConfig(16, 32, 512, tma=True),
                                x_scale=scale)
    odd_upper, odd_lower, odd_nesting, _ = layer(device, 48, 40, 4)  # 40-byte rows: not 16-byte strides
    odd_q, odd_scale = quantize_per_token(torch.randn(5, 40).half().to(device))
    with pytest.raises(ConfigError, match="16-byte aligned"):
        nested_gemm.nested_gemm(odd_q, odd_upper, odd_lower, None, odd_nesting, "fp8",
                                config=GemmConfig(16, 32, 32, tma=True), x_scale=odd_scale)


COMPILE_REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "compile_report.py"
_TMA_PTX = """
import importlib.util, json, re, sys
spec = importlib.util.spec_from_file_location("compile_report", sys.argv[1])
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)
from elastiserve.kernels.configs import GemmConfig
ptx = report.compile_gemm_tma("fp8", GemmConfig(16, 64, 128, num_stages=4), 90, has_bias=True).asm["ptx"]
count = lambda pattern: len(re.findall(pattern, ptx))
print(json.dumps({"bulk": count(r"cp\\.async\\.bulk\\.tensor"), "wgmma": count(r"wgmma\\.mma_async"),
                  "cp_async": count(r"cp\\.async\\.(ca|cg)"), "spills": report.ptxas_usage(ptx, 90)[1]}))
"""


@pytest.mark.cpu
def test_compiled_for_sm90_it_fetches_by_tma_and_multiplies_by_wgmma():
    """On the CPU, Triton's own ptxas (no GPU): bulk tensor copies, no cp.async, async wgmma, no spills."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _TMA_PTX, str(COMPILE_REPORT)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["bulk"] > 0 and found["wgmma"] > 0 and found["cp_async"] == 0 and found["spills"] == 0, found


_FULL_TMA_REPORT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("compile_report", sys.argv[1])
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)
print(json.dumps([{k: row[k] for k in ("operand", "k_loop_sass", "spill_store_bytes")} for row in
                  report.full_tma_report(90)]))
"""


@pytest.mark.cpu
def test_full_tma_table_compiles_and_shared_b_tiles_run_shorter_k_loops():
    """Full mode's TMA table compiled for sm90 on the CPU: no tile spills, and every shared-B tile's K loop (16-byte
    plane loads, session 36) is shorter in SASS than every register-A tile's (two-byte loads and byte permutes)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _FULL_TMA_REPORT, str(COMPILE_REPORT)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    assert rows and all(row["spill_store_bytes"] == 0 for row in rows), rows
    loops = {kind: [row["k_loop_sass"] for row in rows if row["operand"] == kind]
             for kind in ("shared B", "register A")}
    assert loops["shared B"] and loops["register A"] and max(loops["shared B"]) < min(loops["register A"]), loops
