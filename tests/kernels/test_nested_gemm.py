"""Pins the nested GEMM kernels against pure-torch math, on CPU (interpreted Triton) and on the GPU.

full mode == x @ W_fp16.T in fp32 then fp16 (W rebuilt exactly from the planes); weight-only fast mode == x @
upper_as_fp16.T; fp8 mode == its per-token-quantized reference, and within an SQNR floor of the fp16 result;
split-K and non-swapped tiles agree; a prescaled E4M3 layer (max|w| = 5, planes of w / 4) matches the fp16 GEMM in
full mode and its references in both fast modes; the activation quantizer is bit-exact; the
``elastiserve::nested_linear`` (with and without ``weight_exp``) and ``elastiserve::quantize_per_token`` ops pass
``torch.library.opcheck``. Shapes are small and odd on CPU
(M not a multiple of the tile), real Llama sizes on CUDA.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from elastiserve.kernels import configs, formats, fp8_activations, nested_gemm
from elastiserve.kernels.configs import GemmConfig
from elastiserve.kernels.formats import Nesting
from elastiserve.platforms import current_platform

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

WEIGHT_STD = {Nesting.E4M3: 0.05, Nesting.E5M2: 4.0}
SQNR_FLOOR_DB = {Nesting.E4M3: 30.0, Nesting.E5M2: 20.0}  # E5M2 keeps 2 mantissa bits: ~25 dB by itself
# FP8 MMA rounds the activations to E4M3 too: two independent E4M3 roundings give ~28.4 dB on Gaussian data
# (~31.4 dB each); the H200 measured 28.8 dB at 1x4096x4096, so the floor leaves ~2 dB for the row-scale rounding.
FP8_MMA_SQNR_FLOOR_DB = {Nesting.E4M3: 26.0, Nesting.E5M2: 20.0}


def _shapes(device: torch.device) -> list[tuple[int, int, int]]:
    if device.type == "cpu":
        return [(1, 48, 40), (5, 48, 64), (33, 48, 40)]
    # 24 and 32 rows: sm90's 32-row full-mode PTX tile and its fp8 rows from 17 (configs.FULL_SM90_ROWS_32,
    # _FP8_SM90_ROWS); 96 rows: the fp8 rows' 128-row bucket and, through the op, the materialized full mode.
    return [(1, 4096, 4096), (256, 4096, 4096), (4096, 4096, 4096), (37, 6144, 4096), (16, 4096, 14336),
            (24, 6144, 4096), (32, 4096, 14336), (96, 28672, 4096)]


def _problem(m, n, k, nesting, device, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * WEIGHT_STD[nesting]).half()
    x = torch.randn(m, k, generator=gen).half()
    b = torch.randn(n, generator=gen).half() if bias else None
    upper, lower = formats.split(w, nesting)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(w), to(b), to(upper), to(lower)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def _sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.float() - want.float()).pow(2).sum().clamp_min(1e-30)
    return float(10 * torch.log10(want.float().pow(2).sum() / noise))


def _exact(x, w, b):
    y = x.float() @ w.float().T
    return (y if b is None else y + b.float()).half()


@pytest.mark.parametrize("nesting", [Nesting.E4M3, Nesting.E5M2])
def test_full_mode_matches_fp16_gemm(device, nesting):
    for m, n, k in _shapes(device):
        x, w, b, upper, lower = _problem(m, n, k, nesting, device, bias=m % 2 == 1)
        y = nested_gemm.nested_gemm(x, upper, lower, b, nesting, "full")
        assert y.shape == (m, n) and y.dtype == torch.float16
        assert _rel_err(y, _exact(x, w, b)) < 1e-2, (m, n, k)


@pytest.mark.parametrize("nesting", [Nesting.E4M3, Nesting.E5M2])
def test_weight_only_matches_reference(device, nesting):
    for m, n, k in _shapes(device):
        x, w, b, upper, lower = _problem(m, n, k, nesting, device)
        y = nested_gemm.nested_gemm(x, upper, lower, b, nesting, "weight_only")
        ref = nested_gemm.nested_linear_ref(x, upper, lower, b, nesting, "weight_only")
        assert _rel_err(y, ref) < 2e-3, (m, n, k)
        assert _sqnr_db(y, _exact(x, w, b)) > SQNR_FLOOR_DB[nesting]


@pytest.mark.parametrize("nesting", [Nesting.E4M3, Nesting.E5M2])
def test_fp8_matches_reference(device, nesting):
    for m, n, k in _shapes(device):
        x, w, b, upper, lower = _problem(m, n, k, nesting, device)
        y = nested_gemm.nested_gemm(x, upper, lower, b, nesting, "fp8")
        ref = nested_gemm.nested_linear_ref(x, upper, lower, b, nesting, "fp8")
        assert _rel_err(y, ref) < 1e-2, (m, n, k)
        assert _sqnr_db(y, _exact(x, w, b)) > FP8_MMA_SQNR_FLOOR_DB[nesting], (m, n, k)


def test_fnuz_reinterpretation_reference_matches_ocp():
    """MI300 path: OCP bytes read as FNUZ with 0x80 -> 0 and scale 2^-7 give the same weights."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN codes never appear in a nested layer
    for nesting in (Nesting.E4M3, Nesting.E5M2):
        if nesting == Nesting.E5M2:
            codes = codes[(codes & 0x7C) != 0x7C]  # inf/NaN
        ocp = nested_gemm.reference_weight(codes[None], codes[None], nesting, "fp8", fnuz=False)
        fnuz = nested_gemm.reference_weight(codes[None], codes[None], nesting, "fp8", fnuz=True)
        assert torch.equal(ocp, fnuz)


@pytest.mark.parametrize("mode", ["full", "weight_only", "fp8"])
def test_tile_variants_agree(device, mode):
    m, n, k = (5, 48, 40) if device.type == "cpu" else (64, 4096, 4096)
    x, _, b, upper, lower = _problem(m, n, k, Nesting.E4M3, device)
    base = nested_gemm.nested_linear_ref(x, upper, lower, b, Nesting.E4M3, mode)
    # block_k >= 32: fp8 tl.dot needs K >= 32 on NVIDIA
    variants = [GemmConfig(16, 32, 32, swap_ab=False), GemmConfig(16, 16, 32, split_k=2),
                GemmConfig(32, 16, 32, split_k=3, swap_ab=False)]
    for config in variants:
        y = nested_gemm.nested_gemm(x, upper, lower, b, Nesting.E4M3, mode, config=config)
        assert _rel_err(y, base) < 1e-2, config


@pytest.mark.parametrize("mode", ["full", "fp8"])
def test_split_k_merged_in_the_launch_equals_the_reduce_kernel(device, mode, monkeypatch):
    """The last split of each tile sums the partials in split order, as the reduce kernel does: bit-equal outputs
    (with bias, a ragged M and N, more tiles than one), arrival counters back at zero after every call, and a second
    call with other inputs (the next layer) still right."""
    from elastiserve.kernels import arrivals
    from elastiserve.platforms import current_platform

    arch = current_platform().arch
    reduce, reduced = nested_gemm.reduce_split_k, []
    monkeypatch.setattr(nested_gemm, "reduce_split_k", lambda *args: reduced.append(1) or reduce(*args))
    m, n, k = (5, 48, 96) if device.type == "cpu" else (16, 6144, 14336)
    configs = [GemmConfig(16, 16, 32, split_k=2), GemmConfig(16, 32, 32, split_k=3, swap_ab=False)]
    for seed, config in enumerate(configs):
        x, _, b, upper, lower = _problem(m, n, k, Nesting.E4M3, device, seed=seed)
        runs = {}
        for merge in (False, True):
            monkeypatch.setitem(nested_gemm.SPLIT_K_MERGE, arch, merge)
            reduced.clear()
            runs[merge] = nested_gemm.nested_gemm(x, upper, lower, b, Nesting.E4M3, mode, config=config)
            assert len(reduced) == (0 if merge else 1)
        assert torch.equal(runs[True], runs[False]), config
        assert _rel_err(runs[True], nested_gemm.nested_linear_ref(x, upper, lower, b, Nesting.E4M3, mode)) < 1e-2
        assert not arrivals.arrival_counters("nested_gemm", device, 1).any()


COMPILE_REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "compile_report.py"
_MERGE_PTX = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("compile_report", sys.argv[1])
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)
from elastiserve.kernels import configs
down = configs.choose_config("sm90", "fp8", 2, 4096, 14336, 132)  # decode's split-K GEMM: down_proj, two splits
print(json.dumps([down.split_k, report.merge_problems(report.compile_gemm("fp8", down, 90, merge=True).asm["ptx"])]))
"""


def test_split_k_merge_ptx_keeps_the_arrival_ordering():
    """Compiled for sm90 (on the CPU, no GPU): the merged split-K epilogue of down_proj's decode tile orders its
    partial stores, the acq_rel arrival and the merge's loads as arrivals.py's proof needs."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _MERGE_PTX, str(COMPILE_REPORT)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [2, []]


def _prescaled_problem(m, n, k, device, seed=5):
    """A layer with max|w| = 5: E4M3 only through the prescale s = 2."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.5).clamp(-4.9, 4.9).half()
    w[w.abs() < 2.0**-10] = 0.0  # a random fp16 below 2^-12 would lose bits at s = 2 (and force E5M2)
    w[1, 2] = -5.0
    x = torch.randn(m, k, generator=gen).half()
    b = torch.randn(n, generator=gen).half()
    nesting, exp, _ = formats.choose_nesting(w)
    assert (nesting, exp) == (Nesting.E4M3, 2)
    upper, lower = formats.split(w, nesting, exp)
    return x.to(device), w.to(device), b.to(device), upper.to(device), lower.to(device)


@pytest.mark.parametrize("mode", ["full", "weight_only", "fp8"])
def test_prescaled_e4m3_layer(device, mode):
    m, n, k = (5, 48, 40) if device.type == "cpu" else (37, 4096, 4096)
    x, w, b, upper, lower = _prescaled_problem(m, n, k, device)
    ref = nested_gemm.nested_linear_ref(x, upper, lower, b, Nesting.E4M3, mode, weight_exp=2)
    for config in (None, GemmConfig(16, 16, 32, split_k=2)):
        y = nested_gemm.nested_gemm(x, upper, lower, b, Nesting.E4M3, mode, weight_exp=2, config=config)
        assert _rel_err(y, ref) < (1e-2 if mode != "weight_only" else 2e-3), config
    if mode == "full":
        assert _rel_err(y, _exact(x, w, b)) < 1e-2
        assert _rel_err(ref, _exact(x, w, b)) < 1e-3
    else:  # the fast weight is the E4M3 rounding of w (3 mantissa bits), not a 4x-off value
        floor = SQNR_FLOOR_DB[Nesting.E4M3] - (3.0 if mode == "fp8" else 0.0)  # fp8 also rounds the activations
        assert _sqnr_db(y, _exact(x, w, b)) > floor
    unscaled = nested_gemm.nested_gemm(x, upper, lower, b, Nesting.E4M3, mode)
    assert _rel_err(unscaled, ref) > 0.1  # the exponent is really applied


def test_corrupted_lower_plane_is_caught(device):
    """The full-mode tolerance is tight enough to see a wrong residual plane."""
    x, w, b, upper, lower = _problem(5, 48, 64, Nesting.E4M3, device)
    y = nested_gemm.nested_gemm(x, upper, lower ^ 0x80, b, Nesting.E4M3, "full")
    assert _rel_err(y, _exact(x, w, b)) > 1e-2


# One pass (short rows; long rows but few of them), then the two-pass loop (many long rows; rows over the limit); each
# long shape also on the split route (fp8_activations.QUANT_SPLIT_ROWS), whose chunk maxima must give the same scale.
LONG_ROWS = [(7, 5000), (fp8_activations.QUANT_FEW_ROWS + 2, 5000), (7, fp8_activations.QUANT_ONE_PASS_MAX_K + 77)]


@pytest.mark.parametrize("m, k, split", [(7, 300, False)] + [(m, k, s) for s in (False, True) for m, k in LONG_ROWS])
def test_quantize_per_token_bit_exact(device, m, k, split, monkeypatch):
    arch = current_platform().arch
    monkeypatch.setitem(fp8_activations.QUANT_SPLIT_ROWS, arch, (1, 1 << 30) if split else (1, 0))
    assert fp8_activations.splits_quantized_rows(m, k) == split
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]).half().to(device)
    x[5, k - 1] = 3e4  # the row's maximum in its last element: the tail chunk counts
    x[3] = 0  # an all-zero row must not divide by zero
    q, scale = fp8_activations.quantize_per_token(x)
    q_ref, scale_ref = fp8_activations.quantize_per_token_ref(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


# On a GPU also 40-300 rows: full mode there is the materialized weight and the vendor GEMM (MATERIALIZE_MIN_M) or,
# with configs.FULL_SM90_TALL_ON, on sm90 the TMA tiles at 33-256 rows (each weight class in each row bucket, the
# register-A and, since session 36, the shared-B tiles).
GPU_OP_SHAPES = [(96, 4096, 4096), (200, 6144, 4096), (130, 16384, 1024), (65, 1024, 8192), (300, 4096, 4096),
                 (48, 6144, 4096), (40, 28672, 1024), (40, 4096, 4096), (50, 2048, 14336), (200, 2048, 14336)]


@pytest.mark.parametrize("tall_tiles", [False, True])
def test_op_matches_launcher(device, tall_tiles, monkeypatch):
    monkeypatch.setattr(configs, "FULL_SM90_TALL_ON", tall_tiles)
    for m, n, k in [(5, 48, 40)] + ([] if device.type == "cpu" else GPU_OP_SHAPES):
        x, _, b, upper, lower = _problem(m, n, k, Nesting.E4M3, device)
        full = torch.ops.elastiserve.nested_linear(x, upper, lower, b, int(Nesting.E4M3), False)
        fast = torch.ops.elastiserve.nested_linear(x, upper, lower, b, int(Nesting.E4M3), True)
        fast_mode = nested_gemm.fast_mode_for(x.shape[0])
        assert _rel_err(full, nested_gemm.nested_linear_ref(x, upper, lower, b, 1, "full")) < 1e-2, m
        assert _rel_err(fast, nested_gemm.nested_linear_ref(x, upper, lower, b, 1, fast_mode)) < 1e-2, m
        assert not torch.equal(full, fast)


@pytest.mark.parametrize("fast", [False, True])
def test_opcheck_nested_linear(device, fast):
    x, _, b, upper, lower = _problem(3, 32, 32, Nesting.E5M2, device)
    torch.library.opcheck(torch.ops.elastiserve.nested_linear.default, (x, upper, lower, b, int(Nesting.E5M2), fast))
    torch.library.opcheck(torch.ops.elastiserve.nested_linear.default, (x, upper, lower, None, 1, fast))
    x, _, b, upper, lower = _prescaled_problem(3, 32, 32, device)
    torch.library.opcheck(torch.ops.elastiserve.nested_linear.default, (x, upper, lower, b, 1, fast, 2))


def test_opcheck_quantize_per_token(device):
    x = torch.randn(3, 40).half().to(device)
    torch.library.opcheck(torch.ops.elastiserve.quantize_per_token.default, (x, False))


def test_launcher_rejects_bad_inputs(device):
    x, _, b, upper, lower = _problem(3, 32, 32, Nesting.E4M3, device)
    with pytest.raises(ValueError):
        nested_gemm.nested_gemm(x.float(), upper, lower, b, 1, "full")
    with pytest.raises(ValueError):
        nested_gemm.nested_gemm(x, upper, lower[:, :16], b, 1, "full")
    with pytest.raises(ValueError):
        nested_gemm.nested_gemm(x, upper, lower, b, 0, "full")
    with pytest.raises(ValueError):
        nested_gemm.nested_gemm(x, upper, lower, b, 1, "full", weight_exp=5)


@pytest.mark.parametrize("m", [17, 32, 64, 100, 256, 512, 4096])
def test_sm90_fp8_tiles_split_only_long_k(m):
    """sm90's fp8 rows from 17 rows (session 16's probe): wide N takes its own tile at 33-256 rows, split-K only at
    K >= 8192 with >= 16 K blocks a split; other archs keep the bucketed table."""
    from elastiserve.kernels import configs

    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096)):
        assert configs.choose_config("sm90", "fp8", m, n, k, 132).split_k == 1
    down = configs.choose_config("sm90", "fp8", m, 4096, 14336, 132)
    assert -(-14336 // down.block_k) >= configs.FP8_SPLIT_MIN_K_BLOCKS * down.split_k
    if m <= 64:
        assert down.split_k == 2  # 64 tiles of 64 weight rows: two splits fill the 132 SMs
    narrow, wide = (configs.choose_config("sm90", "fp8", m, n, 4096, 132) for n in (6144, 28672))
    assert (narrow != wide) == (32 < m <= 256)
    assert narrow.block_m <= max(32, m) and wide.block_m <= max(32, 2 * m)
    sm80 = configs.choose_config("sm80", "fp8", m, 6144, 4096, 108)
    assert sm80 == replace(configs.TABLES["sm80"]["fp8"][configs.m_bucket(m)], split_k=sm80.split_k)


@pytest.mark.parametrize("m", [1, 2, 7, 16])
def test_sm90_fp8_decode_row(m):
    """sm90's fp8 decode row (session 17's probe): 16-row token tiles, 16x64x512 up to N = 8192 and 16x128x256 wider,
    split-K only from K = 8192 (the down projection: two splits of 14 K blocks); the MoE kernel keeps the bucketed
    rows at these sizes."""
    from elastiserve.kernels import configs

    qkv, o, gate_up, down = (configs.choose_config("sm90", "fp8", m, n, k, 132)
                             for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)))
    assert (qkv.block_m, qkv.block_n, qkv.block_k) == (o.block_m, o.block_n, o.block_k) == (16, 64, 512)
    assert (gate_up.block_m, gate_up.block_n, gate_up.block_k) == (16, 128, 256)
    assert qkv.split_k == o.split_k == gate_up.split_k == 1 and down.split_k == 2 and down.block_k == 512
    grouped = configs.choose_grouped_config("sm90", "fp8", m, 1536, 2048, 132)
    assert grouped == replace(configs.TABLES["sm90"]["fp8"][configs.m_bucket(m)], split_k=1)
