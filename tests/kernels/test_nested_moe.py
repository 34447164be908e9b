"""Pins the grouped (MoE) nested GEMM: the device-built tile map, and every mode against the per-expert reference.

Expert groups include an empty expert, a single token and groups that are not a multiple of the row tile; rows
gathered by ``source_rows`` equal the kernel on a sorted copy, bit for bit; the ops ``elastiserve::nested_moe`` and
``elastiserve::grouped_gemm`` pass ``torch.library.opcheck`` with and without ``source_rows``. A stacked expert
tensor with max|w| = 5 nests as E4M3 with one prescale exponent for all experts and matches in every mode.
"""

import itertools
from dataclasses import replace

import pytest
import torch

from elastiserve.kernels import formats, nested_gemm, nested_moe
from elastiserve.kernels.formats import Nesting

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

WEIGHT_STD = {Nesting.E4M3: 0.05, Nesting.E5M2: 4.0}


def _problem(device, nesting, counts, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_experts = len(counts)
    w = (torch.randn(num_experts, n, k, generator=gen) * WEIGHT_STD[nesting]).half()
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    x = torch.randn(int(offsets[-1]), k, generator=gen).half()
    upper, lower = formats.split(w, nesting)
    return x.to(device), w.to(device), upper.to(device), lower.to(device), offsets.to(device)


def _case(device):
    if device.type == "cpu":
        return [3, 0, 17, 1, 12], 48, 40
    gen = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 80, (128,), generator=gen)
    counts[5] = 0
    return counts.tolist(), 768, 2048  # Qwen3-30B-A3B down-projection-like experts


def _rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def test_tile_map_enumerates_every_row_once():
    offsets = torch.tensor([0, 3, 3, 20, 21, 33], dtype=torch.int32)
    tile_expert, tile_row = nested_moe.build_tile_map_ref(offsets, 33, 16)
    assert tile_expert.numel() == 3 + 5  # cdiv(33, 16) + E: static, no host sync
    covered = []
    for e, start in zip(tile_expert.tolist(), tile_row.tolist()):
        if e >= 0:
            end = min(start + 16, int(offsets[e + 1]))
            assert start >= offsets[e]
            covered += [(row, e) for row in range(start, end)]
    expected = [(row, e) for e in range(5) for row in range(int(offsets[e]), int(offsets[e + 1]))]
    assert sorted(covered) == expected


@pytest.mark.parametrize(("num_experts", "block_m"), [(5, 16), (128, 16), (128, 128), (60, 64)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tile_map_kernel_equals_reference(device, num_experts, block_m, dtype):
    """The one-launch tile map equals the torch reference, padding included, for skewed and empty experts."""
    gen = torch.Generator().manual_seed(num_experts + block_m)
    counts = torch.randint(0, 3 * block_m, (num_experts,), generator=gen)
    counts[::7] = 0
    offsets = torch.zeros(num_experts + 1, dtype=dtype)
    offsets[1:] = counts.cumsum(0)
    total = int(offsets[-1])
    got = nested_moe.build_tile_map(offsets.to(device), total, block_m)
    want = nested_moe.build_tile_map_ref(offsets, total, block_m)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("mode", ["full", "weight_only", "fp8"])
@pytest.mark.parametrize("nesting", [Nesting.E4M3, Nesting.E5M2])
def test_grouped_gemm_matches_reference(device, mode, nesting):
    counts, n, k = _case(device)
    x, w, upper, lower, offsets = _problem(device, nesting, counts, n, k)
    y = nested_moe.nested_moe_gemm(x, upper, lower, offsets, nesting, mode)
    ref = nested_moe.nested_moe_ref(x, upper, lower, offsets, nesting, mode)
    assert y.shape == (x.shape[0], n)
    assert _rel_err(y, ref) < 1e-2
    if mode == "full":  # the reference itself must be the exact fp16 weights
        bounds = offsets.tolist()
        exact = torch.cat([x[s:t].float() @ w[e].float().T for e, (s, t) in enumerate(itertools.pairwise(bounds))])
        assert _rel_err(y, exact) < 1e-2


@pytest.mark.parametrize("mode", ["plain", "full", "weight_only", "fp8"])
def test_gathered_rows_equal_a_sorted_copy(device, mode):
    """With ``source_rows`` the kernel reads row t of the product from x[source_rows[t]] (each token several times,
    as top-k routing sends it): bit-equal to the kernel on the sorted copy, fp8 included (a token is quantized once,
    its scale gathered with it), and the reference agrees."""
    counts, n, k = _case(device)
    sorted_x, w, upper, lower, offsets = _problem(device, Nesting.E4M3, counts, n, k, seed=5)
    rows = sorted_x.shape[0]
    tokens = max(1, rows // 3)
    gen = torch.Generator().manual_seed(6)
    source = torch.randint(0, tokens, (rows,), generator=gen).to(device)
    x = torch.randn(tokens, k, generator=gen).half().to(device)
    if mode == "plain":
        y = nested_moe.grouped_gemm_fp16(x, w, offsets, source_rows=source)
        copy = nested_moe.grouped_gemm_fp16(x[source], w, offsets)
        ref = nested_moe.grouped_gemm_ref(x, w, offsets, source)
    else:
        y = nested_moe.nested_moe_gemm(x, upper, lower, offsets, Nesting.E4M3, mode, source_rows=source)
        copy = nested_moe.nested_moe_gemm(x[source], upper, lower, offsets, Nesting.E4M3, mode)
        ref = nested_moe.nested_moe_ref(x, upper, lower, offsets, Nesting.E4M3, mode, source_rows=source)
    assert y.shape == (rows, n) and torch.equal(y, copy)
    assert _rel_err(y, ref) < 1e-2
    with pytest.raises(ValueError, match="int64"):
        nested_moe.grouped_gemm_fp16(x, w, offsets, source_rows=source.int())


def test_grouped_gemm_equals_dense_per_expert(device):
    counts, n, k = _case(device)
    x, _, upper, lower, offsets = _problem(device, Nesting.E4M3, counts, n, k, seed=2)
    y = nested_moe.nested_moe_gemm(x, upper, lower, offsets, Nesting.E4M3, "full")
    bounds = offsets.tolist()
    for e in range(len(counts)):
        if bounds[e + 1] > bounds[e] and e % 7 == 0:
            dense = nested_gemm.nested_gemm(x[bounds[e]:bounds[e + 1]], upper[e], lower[e], None, 1, "full")
            assert _rel_err(y[bounds[e]:bounds[e + 1]], dense) < 1e-2


@pytest.mark.parametrize("mode", ["full", "weight_only", "fp8"])
def test_prescaled_experts(device, mode):
    counts, n, k = _case(device)
    x, w, upper, lower, offsets = _problem(device, Nesting.E4M3, counts, n, k, seed=4)
    w = torch.where(w.abs() < 2.0**-10, torch.zeros_like(w), w)  # random fp16 below 2^-12 would lose bits at s = 2
    w[2, 0, 1] = 5.0  # one expert's outlier sets the exponent of the whole stacked tensor
    nesting, exp, _ = formats.choose_nesting(w.cpu())
    assert (nesting, exp) == (Nesting.E4M3, 2)
    upper, lower = formats.split(w, nesting, exp)
    y = nested_moe.nested_moe_gemm(x, upper, lower, offsets, nesting, mode, weight_exp=exp)
    ref = nested_moe.nested_moe_ref(x, upper, lower, offsets, nesting, mode, weight_exp=exp)
    assert _rel_err(y, ref) < 1e-2
    bounds = offsets.tolist()
    exact = torch.cat([x[s:t].float() @ w[e].float().T for e, (s, t) in enumerate(itertools.pairwise(bounds))])
    assert _rel_err(y, exact) < (1e-2 if mode == "full" else 0.1)


@pytest.mark.parametrize("fast", [False, True])
def test_opcheck_nested_moe(device, fast):
    x, _, upper, lower, offsets = _problem(device, Nesting.E4M3, [2, 0, 5], 32, 32)
    torch.library.opcheck(torch.ops.elastiserve.nested_moe.default, (x, upper, lower, offsets, 1, fast))
    torch.library.opcheck(torch.ops.elastiserve.nested_moe.default, (x, upper, lower, offsets, 1, fast, 3))


def test_plain_fp16_experts_match_reference(device):
    """Unnested fp16 experts through the same kernel (static-fp16 MoE): against the fp32 per-expert product."""
    counts, n, k = _case(device)
    x, w, _, _, offsets = _problem(device, Nesting.E5M2, counts, n, k)
    y = nested_moe.grouped_gemm_fp16(x, w, offsets)
    ref = nested_moe.grouped_gemm_ref(x, w, offsets)
    assert y.shape == (x.shape[0], n) and y.dtype == torch.float16
    assert _rel_err(y, ref) < 2e-3  # fp32 accumulation on both sides: only the output rounding differs
    with pytest.raises(ValueError, match="fp16"):
        nested_moe.grouped_gemm_fp16(x, w.float(), offsets)


def test_opcheck_grouped_gemm(device):
    x, w, upper, lower, offsets = _problem(device, Nesting.E4M3, [2, 0, 5], 32, 32)
    torch.library.opcheck(torch.ops.elastiserve.grouped_gemm.default, (x, w, offsets))
    source = torch.tensor([1, 0, 3, 3, 2, 0, 1], device=device)  # 7 product rows out of 4 tokens
    torch.library.opcheck(torch.ops.elastiserve.grouped_gemm.default, (x[:4], w, offsets, source))
    for fast in (False, True):
        torch.library.opcheck(torch.ops.elastiserve.nested_moe.default,
                              (x[:4], upper, lower, offsets, 1, fast, 0, source))


def test_grouped_gemm_compiles_fullgraph(device):
    torch._dynamo.reset()
    x, w, _, _, offsets = _problem(device, Nesting.E4M3, [2, 0, 5], 32, 32)

    def experts(x):
        return torch.ops.elastiserve.grouped_gemm(torch.relu(x), w, offsets) * 2

    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    torch.testing.assert_close(compiled(x), experts(x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("rows_per_expert", [1, 16, 64, 128, 256, 2048])
def test_grouped_tiles_per_arch(rows_per_expert):
    """sm90 takes the probed prefill tiles from 64 rows per expert (full with the PTX decode, 128-row tiles); plain
    experts never decode; other archs keep the dense rows; an unknown mode is a typed error."""
    from elastiserve.kernels import configs
    from elastiserve.platforms import ConfigError

    n, k = 1536, 2048
    plain = configs.choose_grouped_config("sm90", "plain", rows_per_expert, n, k, 132)
    full = configs.choose_grouped_config("sm90", "full", rows_per_expert, n, k, 132)
    assert not plain.ptx_decode and full.ptx_decode and full.split_k == plain.split_k == 1
    if rows_per_expert >= 64:
        assert full.block_m >= 128 and plain.block_m >= 128
    else:
        assert full == replace(configs.choose_config("sm90", "full", rows_per_expert, n, k, 132), split_k=1)
    for arch in ("sm80", "gfx942", "cpu"):
        other = configs.choose_grouped_config(arch, "full", rows_per_expert, n, k, 108)
        assert not other.ptx_decode and other.split_k == 1
    with pytest.raises(ConfigError):
        configs.choose_grouped_config("sm90", "fp4", rows_per_expert, n, k, 132)



def test_a_register_cap_is_validated_and_needs_an_nvidia_gpu(device):
    """``GemmConfig.max_registers`` (PTX .maxnreg) is a probe knob: out of range it is a typed error, and off an
    NVIDIA GPU (the CPU interpreter here) the launch refuses it instead of ignoring it."""
    from elastiserve.kernels import configs
    from elastiserve.platforms import ConfigError

    with pytest.raises(ConfigError, match="max_registers"):
        configs.GemmConfig(64, 64, 64, max_registers=300)
    capped = configs.GemmConfig(64, 64, 64, max_registers=128)
    assert nested_gemm.register_cap(configs.GemmConfig(64, 64, 64)) == {}
    if device.type == "cpu":
        with pytest.raises(ConfigError, match="max_registers needs an NVIDIA GPU"):
            nested_gemm.register_cap(capped)
    else:
        assert nested_gemm.register_cap(capped) == {"maxnreg": 128}
