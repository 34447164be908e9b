"""``benchmarks/engine/profile_mixed_step.py`` on a tiny random Qwen3-MoE on the CPU (reference kernels): every
(policy, chunk) row has decode and mixed step times, profiles of the mixed steps and of a decode step, and host
operators.
"""

from __future__ import annotations

import json

import pytest
from engine_scripts import load_engine_script

pytestmark = [pytest.mark.cpu]

TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
}  # fmt: skip


def load_script():
    return load_engine_script("profile_mixed_step")


def test_profile_mixed_step_on_a_tiny_moe(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # reference kernels on the CPU: seconds, not minutes
    out = tmp_path / "mixed.json"
    load_script().main(["--device", "cpu", "--model", json.dumps(TINY_MOE), "--policies", "static-fp16",
                        "--batch", "2", "--context", "8", "--chunk", "12", "24", "--repeats", "2",
                        "--max-model-len", "96", "--cpu-kv-blocks", "64", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["metadata"]["settings"]["chunk"] == [12, 24]
    rows = data["rows"]
    assert [(r["policy"], r["chunk"]) for r in rows] == [("static-fp16", 12), ("static-fp16", 24)]
    assert all(r["decode_step_median_s"] > 0 and r["mixed_step_median_s"] > 0 for r in rows)
    assert all(len(r["mixed_profiles"]) == 1 for r in rows)
    for prof in (*rows[0]["mixed_profiles"], *rows[1]["mixed_profiles"], rows[1]["decode_profile"]):
        assert prof["wall_under_profiler_s"] > 0 and prof["top_host_ops"]
        assert all(op["count"] >= 1 and op["self_cpu_ms"] >= 0 for op in prof["top_host_ops"])
