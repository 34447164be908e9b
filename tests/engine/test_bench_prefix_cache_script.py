"""``benchmarks/engine/bench_prefix_cache.py`` on a tiny random Llama on the CPU: both engines finish every request,
the cache serves the shared prefix's whole pairs to every request after the first, and the uncached engine's
counter stays at zero."""

from __future__ import annotations

import json

import pytest
from engine_scripts import load_engine_script

pytestmark = [pytest.mark.cpu]

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
}  # fmt: skip


def test_bench_prefix_cache_on_a_tiny_llama(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # reference kernels on the CPU
    module = load_engine_script("bench_prefix_cache")
    out = tmp_path / "prefix.json"
    # 6 requests of 80 tokens, 64 shared: 2 whole 32-token pairs (block 16) from the cache for each of 5 requests
    module.main(["--device", "cpu", "--model", json.dumps(TINY_LLAMA), "--load-format", "dummy", "--requests", "6",
                 "--input-len", "80", "--shared-prefix", "64", "--output-len", "3", "--rate", "50", "--out", str(out)])
    off, on = json.loads(out.read_text())["runs"]
    assert off["finished"] == on["finished"] == 6 and off["prompt_tokens"] == on["prompt_tokens"] == 480
    assert off["cache_hit_tokens"] == 0
    assert on["cache_hit_tokens"] <= 5 * 64 and on["cache_hit_tokens"] % 32 == 0 and on["cache_hit_tokens"] > 0
