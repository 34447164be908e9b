"""``benchmarks/engine/profile_decode_kernels.py`` on a tiny random Llama on the CPU: both modes profiled per batch,
every profiled operator's time lands in exactly one family, and the JSON keeps the settings and commit."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu]

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "engine"
TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}  # fmt: skip


def load_script():
    sys.path.insert(0, str(SCRIPTS))  # it imports decode_setup's helpers
    try:
        spec = importlib.util.spec_from_file_location("profile_decode_kernels", SCRIPTS / "profile_decode_kernels.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def test_profiles_both_modes_on_a_tiny_config(tmp_path, capsys):
    script = load_script()
    out = tmp_path / "kernels.json"
    script.main(["--device", "cpu", "--model", json.dumps(TINY), "--batch", "1", "2", "--context", "12",
                 "--replays", "2", "--max-model-len", "64", "--out", str(out)])
    data = json.loads(out.read_text())
    assert len(data["metadata"]["commit"]) == 40 and data["metadata"]["settings"]["batches"] == [1, 2]
    assert [row["batch"] for row in data["steps"]] == [1, 2]
    for row in data["steps"]:
        for mode in ("full", "fast"):
            step = row[mode]
            assert step["total_us"] > 0 and step["kernels"]
            assert sum(step["families_us"].values()) == pytest.approx(step["total_us"])
    assert "full" in capsys.readouterr().out


def test_kernel_names_fall_into_families():
    script = load_script()
    assert script.family("_nested_gemm_kernel") == "nested GEMM (fp8 / weight-only / full)"
    assert script.family("_rms_norm_kernel") == "norm (plain or quantizing)"
    for name in ("_silu_and_mul_quant_kernel", "_silu_mul_chunk_max_kernel"):
        assert script.family(name) == "SiLU-and-mul (plain or quantizing)", name
    for name in ("_quantize_per_token_kernel", "_chunk_max_kernel", "_quantize_chunk_kernel"):  # the split's shared
        assert script.family(name) == "quantizer (o_proj's input; split routes' codes)", name
    assert script.family("paged_attention_kernel") == "attention"
    assert script.family("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTN") == "vendor GEMM (lm_head, fp16 layers)"
    assert script.family("something_else") == "other"
