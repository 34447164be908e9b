"""``benchmarks/kernels/probe_skinny_gemm.py`` without a GPU: its candidate lists stay within the probe's limits (at
most 10 skinny configs per mode, BLOCK_N * BLOCK_K <= 16384, the PTX decode on the nested modes, split-K from the
occupancy rule), the full run compiles fewer than ``MAX_VARIANTS`` kernel variants on the H200 and ``--quick`` a
subset of them, and ``main`` refuses to run on the CPU. No GPU code runs here."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from kernel_scripts import load_kernel_script

pytestmark = [pytest.mark.cpu]


@pytest.fixture(scope="module")
def probe():
    return load_kernel_script("probe_skinny_gemm")


def test_candidates_stay_within_the_probe_limits(probe):
    num_sms = probe.H200[1]
    for mode in probe.MODES:
        found = [c for n, k in probe.SHAPES.values() for m in probe.M_VALUES
                 for c in probe.candidates(mode, m, n, k, num_sms)]
        assert len({replace(c, split_k=1) for c in found}) <= 10, mode
        for c in found:
            assert c.block_n in (8, 16, 32) and c.block_k in (256, 512, 1024) and c.num_warps in (4, 8), c
            assert c.block_n * c.block_k <= 16384 and c.ptx_decode == (mode != "plain"), c
    o_proj = probe.candidates("full", 1, *probe.SHAPES["o"], num_sms)
    assert any(c.split_k > 1 for c in o_proj)  # 4096 columns: too few programs without split-K


def test_compiled_variants_stay_under_the_bound(probe):
    full = probe.compiled_variants(probe.SHAPES.values(), probe.M_VALUES)
    quick = probe.compiled_variants([probe.SHAPES["qkv"]], (1,))
    assert len(full) < probe.MAX_VARIANTS <= 150
    assert quick < full and len(quick) <= 24
    assert len({key[1:] for key in full if key[0] == "skinny"}) > 60  # every mode and M really is counted


def test_main_refuses_without_a_gpu(probe, tmp_path):
    out = tmp_path / "skinny.json"
    assert probe.main(["--out", str(out), "--quick"]) == 2
    assert not out.exists()


def test_main_logic_with_the_gpu_parts_faked(probe, monkeypatch, tmp_path, capsys):
    """Tiny shapes under the interpreter, weights and timer faked: reference checks, table and JSON all run; a
    candidate that cannot run (the PTX decode on a CPU) or is wrong is recorded as failed, never as the best."""
    import torch

    from elastiserve.kernels import formats, skinny_gemm
    from elastiserve.kernels.formats import Nesting
    from elastiserve.platforms import current_platform

    def weights(n, k, copies):
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05).half()
        upper, lower = formats.split(w, Nesting.E4M3)
        return [{"w": w, "upper": upper, "lower": lower}] * copies

    launcher = skinny_gemm.skinny_linear

    def wrong_for_narrow_tiles(x, weight, bias=None, config=None):
        y = launcher(x, weight, bias, config)
        return y if config.block_n == 16 else y * 1.5

    current_platform()  # resolve (and cache) the CPU platform before torch is told it has a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "fake GPU")
    for name, value in (("DEVICE", "cpu"), ("SHAPES", {"qkv": (40, 64)}), ("TILES_M1", ((8, 32, 4), (16, 16, 4))),
                        ("make_weights", weights), ("copies_for", lambda _: 2),
                        ("graph_time_us", lambda calls: [call() for call in calls] and 10.0)):
        monkeypatch.setattr(probe, name, value)
    monkeypatch.setattr(probe.skinny_gemm, "skinny_linear", wrong_for_narrow_tiles)
    out = tmp_path / "skinny.json"
    assert probe.main(["--out", str(out), "--quick"]) == 0
    result = json.loads(out.read_text())
    skinny = [r for r in result["rows"] if r["kind"] == "skinny"]
    assert {r["kind"] for r in result["rows"]} == {"torch_fp16", "nested", "skinny"} and len(skinny) == 6
    assert all(r["us"] for r in result["rows"] if r["kind"] != "skinny")
    plain = {r["config"]["block_n"]: r for r in skinny if r["mode"] == "plain"}
    assert plain[16]["us"] == 10.0 and plain[16]["rel_err"] < 1e-3
    assert plain[8]["us"] is None and "wrong result" in plain[8]["error"]
    assert all("ptx_decode" in r["error"] for r in skinny if r["mode"] != "plain")
    assert [(b["mode"], b["config"]["block_n"], b["vs_torch_fp16"]) for b in result["best"]] == [("plain", 16, 1.0)]
    assert "best skinny config" in capsys.readouterr().out and not result["truncated"]


def test_cli_filters_narrow_the_run(probe):
    """``--shapes / --m / --modes / --tiles`` narrow the compile count to what was asked for."""
    tiles = [probe._tile("8,2048,16"), probe._tile("4,4096,16")]
    narrow = probe.compiled_variants([probe.SHAPES["o"]], (1,), modes=("weight_only",), tiles=tiles)
    skinny = {key for key in narrow if key[0] == "skinny"}
    assert {(key[1], key[2], key[3], key[4]) for key in skinny} == {("weight_only", 8, 2048, 16),
                                                                 ("weight_only", 4, 4096, 16)}
    with pytest.raises(ValueError):
        probe._tile("8,2048")
    assert "lm_head" in probe.EXTRA_SHAPES and "lm_head" not in probe.SHAPES  # timed only when named
