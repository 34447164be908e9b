"""Pins the skinny (GEMV-style) decode GEMM against exact float64 math, on CPU (interpreted Triton) and on the GPU.

Every output must sit within a bound derived from K: fp32 accumulation (``(K + 8) * 2^-24 * sum|x * w|``) plus the
fp16 rounding of the result (``2^-11 * |y|``); a reference missing one K column falls outside it, so a kernel that
drops a K block, a row or a residual bit fails. Covered: plain fp16 weights, nested full and weight-only modes in both
nestings, M in {1, 3, 8}, N off the tile, K with and without a K tail (EVEN_K), split-K 1 and 3, the deferred and the
per-step K reduction, bias and none, a prescaled E4M3 layer; ``elastiserve::skinny_linear`` passes ``opcheck``;
``nested_gemm.nested_gemm`` routes M <= 8 to the skinny kernel on the interpreter and M = 9 to the tl.dot kernel,
and no GPU arch routes anything there by default; compiled for sm90 (CPU only), the main loop has no layout
conversion or barrier.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from elastiserve.kernels import configs, formats, nested_gemm, skinny_configs, skinny_gemm
from elastiserve.kernels.configs import GemmConfig
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.skinny_configs import SkinnyConfig
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]  # and cuda where marked: the routing tests pin the interpreter's table

WEIGHT_STD = {Nesting.E4M3: 0.05, Nesting.E5M2: 4.0}
ROWS = (1, 3, 8)
# (N, K, config): None is the platform's own tile (cpu: 16x32); N = 40 and 24 are off every BLOCK_N here.
CASES = [
    (40, 48, None),  # K tail (EVEN_K False), split 1
    (40, 64, SkinnyConfig(16, 32, num_stages=1)),  # EVEN_K True
    (40, 96, SkinnyConfig(16, 16, num_stages=1, split_k=3)),  # split 3, EVEN_K True (96 = 3 * 2 * 16)
    (40, 40, SkinnyConfig(8, 16, num_stages=1, split_k=3)),  # split 3 with a K tail
    (24, 64, SkinnyConfig(16, 512, num_warps=1, num_stages=1)),  # M_PAD >= 4 reduces each step (DEFER False)
]


def _config(config, m, n, k):
    return config or skinny_configs.skinny_config("cpu", "plain", m, n, k, 1)


def test_cases_cover_the_kernel_variants():
    flags = {(m, c.split_k > 1, k % (c.block_k * c.split_k) == 0,
              skinny_gemm.defers_reduction(c, triton.next_power_of_2(m), "plain"))
             for m in ROWS for n, k, config in CASES for c in [_config(config, m, n, k)]}
    assert {f[1] for f in flags} == {False, True} and {f[2] for f in flags} == {False, True}
    assert {(f[0], f[3]) for f in flags} >= {(1, True), (3, True), (8, True), (3, False), (8, False)}


def _within_bound(y, x, w, b):
    """True where |y - x @ w.T - b| fits fp32 accumulation over K plus fp16 output rounding (float64 reference)."""
    k = x.shape[1]
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    if b is not None:
        exact, magnitude = exact + b.double(), magnitude + b.double().abs()
    bound = (k + 8) * 2.0**-24 * magnitude * (1 + 2.0**-10) + 2.0**-11 * exact.abs() + 2.0**-24
    return (y.double() - exact).abs() <= bound


def _assert_close(y, x, w, b, what):
    ok = _within_bound(y, x, w, b)
    assert bool(ok.all()), f"{what}: {int((~ok).sum())} of {ok.numel()} outside the bound"


def _plain(m, n, k, device, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).half()
    w = (torch.randn(n, k, generator=gen) * 0.05).half()
    b = torch.randn(n, generator=gen).half() if bias else None
    return x.to(device), w.to(device), None if b is None else b.to(device)


def _nested(m, n, k, nesting, device, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).half()
    w = (torch.randn(n, k, generator=gen) * WEIGHT_STD[nesting]).half()
    b = torch.randn(n, generator=gen).half() if bias else None
    upper, lower = formats.split(w, nesting)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(w), to(b), to(upper), to(lower)


@pytest.mark.cuda
@pytest.mark.parametrize("m", ROWS)
def test_plain_matches_exact(device, m):
    for i, (n, k, config) in enumerate(CASES):
        x, w, b = _plain(m, n, k, device, seed=i, bias=i % 2 == 0)
        y = skinny_gemm.skinny_linear(x, w, b, config)
        assert y.shape == (m, n) and y.dtype == torch.float16
        _assert_close(y, x, w, b, (m, n, k, config))


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["full", "weight_only"])
@pytest.mark.parametrize("nesting", [Nesting.E4M3, Nesting.E5M2])
def test_nested_matches_exact(device, nesting, mode):
    for m in ROWS:
        for i in (0, 3, 4) if m == 8 else (0, 3):
            n, k, config = CASES[i]
            x, _, b, upper, lower = _nested(m, n, k, nesting, device, seed=i, bias=m != 3)
            y = skinny_gemm.skinny_nested(x, upper, lower, b, nesting, mode, config=config)
            w = nested_gemm.reference_weight(upper, lower, nesting, mode)  # exactly the fp16 weight in full mode
            _assert_close(y, x, w, b, (mode, m, n, k, config))


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["full", "weight_only"])
def test_prescaled_e4m3_layer(device, mode):
    """max|w| = 5 is E4M3 only through the prescale 2^2: the planes hold w / 4 and the epilogue multiplies by 4."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(40, 48, generator=gen) * 0.5).clamp(-4.9, 4.9).half()
    w[w.abs() < 2.0**-10] = 0.0  # a random fp16 below 2^-12 would lose bits at the prescale (and force E5M2)
    w[1, 2] = -5.0
    x, b = torch.randn(3, 48, generator=gen).half().to(device), torch.randn(40, generator=gen).half().to(device)
    nesting, exp, _ = formats.choose_nesting(w)
    assert (nesting, exp) == (Nesting.E4M3, 2)
    upper, lower = (t.to(device) for t in formats.split(w, nesting, exp))
    w_eff = nested_gemm.reference_weight(upper, lower, nesting, mode, weight_exp=exp)
    if mode == "full":
        assert torch.equal(w_eff, w.float().to(device))
    for config in (None, CASES[3][2]):
        y = skinny_gemm.skinny_nested(x, upper, lower, b, nesting, mode, weight_exp=exp, config=config)
        _assert_close(y, x, w_eff, b, config)
    unscaled = skinny_gemm.skinny_nested(x, upper, lower, b, nesting, mode)
    assert not bool(_within_bound(unscaled, x, w_eff, b).all())  # the exponent is really applied


@pytest.mark.cuda
def test_bound_rejects_near_misses(device):
    """The tolerance sees one missing K column, a corrupted residual plane and a dropped bias."""
    x, w, b, upper, lower = _nested(3, 40, 48, Nesting.E4M3, device)
    y = skinny_gemm.skinny_nested(x, upper, lower, b, Nesting.E4M3, "full")
    _assert_close(y, x, w, b, "full")
    short = w.clone()
    short[:, -1] = 0
    assert not bool(_within_bound(y, x, short, b).all())
    broken = skinny_gemm.skinny_nested(x, upper, lower ^ 0x01, b, Nesting.E4M3, "full")  # lowest mantissa bit
    assert not bool(_within_bound(broken, x, w, b).all())
    assert not bool(_within_bound(skinny_gemm.skinny_nested(x, upper, lower, None, 1, "full"), x, w, b).all())


@pytest.mark.cuda
def test_opcheck_skinny_linear(device):
    x, w, b = _plain(3, 24, 32, device)
    torch.library.opcheck(torch.ops.elastiserve.skinny_linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.elastiserve.skinny_linear.default, (x, w, None))


def test_skinny_linear_compiles_fullgraph(device):
    torch._dynamo.reset()
    x, w, b = _plain(2, 24, 32, device)
    w2 = w[:, :24].contiguous()

    def two_layers(x):
        return torch.ops.elastiserve.skinny_linear(torch.relu(torch.ops.elastiserve.skinny_linear(x, w, b)), w2, None)

    compiled = torch.compile(two_layers, fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    torch.testing.assert_close(compiled(x), two_layers(x), rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
def test_rejects_bad_inputs(device):
    x, w, b = _plain(3, 24, 32, device)
    _, _, _, upper, lower = _nested(3, 24, 32, Nesting.E4M3, device)
    with pytest.raises(ValueError, match="x must be 2-D fp16"):
        skinny_gemm.skinny_linear(x.float(), w, b)
    with pytest.raises(ValueError, match="weight must be 2-D fp16"):
        skinny_gemm.skinny_linear(x, w.float(), b)
    with pytest.raises(ValueError, match="K=16"):
        skinny_gemm.skinny_linear(x[:, :16], w, b)
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm.skinny_linear(x, w, b[:8])
    with pytest.raises(ConfigError, match="at most 8 rows"):
        skinny_gemm.skinny_linear(torch.zeros(9, 32, dtype=torch.float16, device=device), w, b, SkinnyConfig(16, 32))
    with pytest.raises(ConfigError, match="plain fp16 weight"):
        skinny_gemm.skinny_linear(x, w, b, SkinnyConfig(16, 32, ptx_decode=True))
    with pytest.raises(ConfigError, match="not 'fp8'"):
        skinny_gemm.skinny_nested(x, upper, lower, b, Nesting.E4M3, "fp8")
    with pytest.raises(ValueError, match="uint8 planes"):
        skinny_gemm.skinny_nested(x, upper, lower[:, :16], b, Nesting.E4M3, "full")


@pytest.mark.parametrize("kwargs", [dict(block_n=24, block_k=32), dict(block_n=16, block_k=8),
                                    dict(block_n=64, block_k=1024), dict(block_n=16, block_k=32, split_k=0),
                                    dict(block_n=16, block_k=32, num_warps=3)])
def test_config_validation(kwargs):
    with pytest.raises(ConfigError):
        SkinnyConfig(**kwargs)


# ---- dispatch (CPU: the interpreter's table routes M <= 8 here; sm90 as the H200 probe measured; others empty) ---


def test_skinny_routing_follows_the_measured_table():
    sm90 = {"plain": 2, "full": 2, "weight_only": 1}  # skinny_configs.SKINNY_MAX_M says where these come from
    for arch in configs.TABLES:
        for mode in skinny_configs.SKINNY_MODES:
            for m in (1, 2, 3):
                routed = skinny_configs.choose_skinny(arch, mode, m, 4096, 4096, 132)
                expected = arch == "cpu" or (arch == "sm90" and m <= sm90[mode])
                assert (routed is not None) == expected, (arch, mode, m)
    assert skinny_configs.choose_skinny("sm90", "full", 1, 6144, 4096, 132) == SkinnyConfig(8, 2048, 8, 3, 1, True)
    assert skinny_configs.choose_skinny("sm90", "plain", 1, 6144, 4096, 132).ptx_decode is False
    two_rows = skinny_configs.choose_skinny("sm90", "plain", 2, 128256, 4096, 132)  # lm_head at batch 2
    assert (two_rows.block_n, two_rows.block_k, two_rows.num_warps, two_rows.split_k) == (4, 2048, 8, 1)
    wide, narrow = (skinny_configs.choose_skinny("sm90", "weight_only", 1, n, 4096, 132) for n in (28672, 6144))
    assert (wide.block_n, wide.block_k, wide.num_warps) == (16, 1024, 8) and narrow.block_k == 2048
    assert skinny_configs.choose_skinny("cpu", "fp8", 1, 64, 64, 2) is None
    assert skinny_configs.choose_skinny("cpu", "full", 9, 64, 64, 2) is None
    with pytest.raises(ConfigError):
        skinny_configs.choose_skinny("cpu", "bogus", 1, 64, 64, 2)
    with pytest.raises(ConfigError):
        skinny_configs.skinny_config("cpu", "full", 9, 64, 64, 2)


def test_split_k_fills_the_sms():
    """At 16-wide tiles o (4096x4096) and down (4096x14336) have 256 column tiles for 132 SMs: split-K at least
    doubles them; gate_up (28672 columns) has programs enough and is not split. sm90's tabled tiles take the same
    rule (8-wide: 512 programs for o, no split), and its nested modes decode with PTX."""
    for n, k, split in ((4096, 4096, 2), (4096, 14336, 2), (28672, 4096, 1)):
        assert skinny_configs.with_skinny_split(SkinnyConfig(16, 256), n, k, 132).split_k == split, (n, k)
        for mode in skinny_configs.SKINNY_MODES:
            config = skinny_configs.skinny_config("sm90", mode, 1, n, k, 132)
            assert config.ptx_decode == (mode != "plain"), (n, k, config)
            assert config == skinny_configs.with_skinny_split(config, n, k, 132), (n, k, config)  # the tile's own split


def test_nested_gemm_routes_decode_rows_to_skinny(monkeypatch, device):
    calls = []
    launcher = skinny_gemm.skinny_nested

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return launcher(x, *args, **kwargs)

    monkeypatch.setattr(skinny_gemm, "skinny_nested", counting)
    for m in (1, 8, 9):
        x, w, b, upper, lower = _nested(m, 40, 48, Nesting.E4M3, device)
        y = nested_gemm.nested_gemm(x, upper, lower, b, Nesting.E4M3, "full")
        _assert_close(y, x, w, b, m)
    nested_gemm.nested_gemm(x[:3], upper, lower, b, Nesting.E4M3, "full", config=GemmConfig(16, 16, 32))
    nested_gemm.nested_gemm(x[:3], upper, lower, b, Nesting.E4M3, "fp8")
    y = torch.ops.elastiserve.nested_linear(x[:3], upper, lower, b, int(Nesting.E4M3), True)
    assert calls == [1, 8, 3]  # M = 9, an explicit GemmConfig and fp8 mode take the tl.dot kernel
    _assert_close(y, x[:3], nested_gemm.reference_weight(upper, lower, Nesting.E4M3, "weight_only"), b, "op")


def test_skinny_linear_op_routes_by_rows(device):
    for m in (3, 9):  # 9: torch's linear
        x, w, b = _plain(m, 24, 40, device)
        _assert_close(torch.ops.elastiserve.skinny_linear(x, w, b), x, w, b, m)
    assert torch.equal(skinny_gemm.skinny_linear_ref(x, w, b), (x.float() @ w.float().T + b.float()).half())


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["full", "weight_only"])
@pytest.mark.parametrize("nesting", [Nesting.E4M3, Nesting.E5M2])
def test_ptx_decode(device, nesting, mode):
    """The packed-PTX decode (NVIDIA only) gives the same weights; elsewhere asking for it raises."""
    x, _, b, upper, lower = _nested(3, 40, 96, nesting, device)
    w = nested_gemm.reference_weight(upper, lower, nesting, mode)
    for config in (SkinnyConfig(16, 32, ptx_decode=True), SkinnyConfig(8, 32, split_k=3, ptx_decode=True)):
        if device.type == "cpu":
            with pytest.raises(ConfigError, match="ptx_decode"):
                skinny_gemm.skinny_nested(x, upper, lower, b, nesting, mode, config=config)
            continue
        _assert_close(skinny_gemm.skinny_nested(x, upper, lower, b, nesting, mode, config=config), x, w, b, config)


# ---- compiled for sm90 on the CPU: the interpreter cannot see layouts, so pin them here -------------------------

COMPILE_REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "compile_report.py"
_COMPILE_SM90 = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("compile_report", sys.argv[1])
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)
from elastiserve.kernels.skinny_configs import SkinnyConfig
cases = [("plain", 1, SkinnyConfig(16, 256), False, True),
         ("full", 2, SkinnyConfig(16, 256, ptx_decode=True), True, False),
         ("weight_only", 8, SkinnyConfig(32, 256, num_warps=1, ptx_decode=True), False, True)]
print(json.dumps([report.loop_facts(report.compile_skinny(mode, m_pad, config, 90, partial, even_k))
                  for mode, m_pad, config, partial, even_k in cases]))
"""


def test_sm90_compile_keeps_the_loop_free_of_layout_traffic():
    """Compiled for sm90 by benchmarks/kernels/compile_report.py (no GPU needed): the x loads share the weight tile's
    layout (no convert_layout, so no shared-memory round trip, in the loop); the deferred variants (M_PAD 1, 2) do no
    cross-lane work per step, and the per-step one (M_PAD 8) reduces with shuffles inside a warp, no barrier."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90, str(COMPILE_REPORT)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    plain, full, weight_only = json.loads(done.stdout.splitlines()[-1])
    quiet = {"loop_convert_layout": 0, "loop_barriers": 0, "loop_shuffles": 0}
    assert {key: plain[key] for key in quiet} == quiet and {key: full[key] for key in quiet} == quiet
    assert weight_only["loop_convert_layout"] == 0 and weight_only["loop_barriers"] == 0
    assert weight_only["loop_shuffles"] > 0
