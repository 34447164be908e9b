"""Pins the weight loaders.

- GGUF -> safetensors conversion of SmolLM2 equals transformers' own GGUF loader tensor for tensor (this validates
  the dequantization and the undoing of llama.cpp's Q/K row permutation); marked slow (transformers' GGUF path
  takes 30-50 s on 2 cores).
- unpermute_rope_rows inverts llama.cpp's permutation bit-exactly.
- Sharded safetensors (with model.safetensors.index.json) load through load_model and give transformers' logits.
- Dummy weights are deterministic per seed, N(0, 0.02) with unit norms, and built-in configs have the published
  parameter counts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from dense_context import DenseAttentionContext, positions_for
from safetensors.torch import load_file

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.loader import (
    BUILTIN_CONFIGS,
    load_hf_config,
    load_model,
    safetensors_files,
    smollm2_dir,
    smollm2_gguf_path,
)
from elastiserve.engine.loader.gguf_convert import unpermute_rope_rows
from elastiserve.engine.models import build_model
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]
on_every_device = pytest.mark.cuda  # plus the module's cpu mark; the rest needs the SmolLM2 files (CPU machine only)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf does to Q and K rows (interleaved rotary pairs instead of halves).
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("num_heads,head_dim,cols", [(3, 64, 5), (9, 8, 7), (1, 2, 1)])
def test_unpermute_inverts_llama_cpp_permutation(num_heads, head_dim, cols):
    weight = np.arange(num_heads * head_dim * cols, dtype=np.float32).reshape(num_heads * head_dim, cols)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight) or head_dim == 2
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, num_heads), weight)


@pytest.mark.slow
def test_gguf_conversion_equals_transformers_gguf_loader():
    gguf = smollm2_gguf_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    expected = reference.state_dict()
    ours = load_file(str(smollm2_dir() / "model.safetensors"))
    assert set(ours) == set(expected) - {"lm_head.weight"}  # tied: the converted directory stores it once
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float16
        # Same dequantized values; ours are stored in fp16, so compare after the same rounding.
        assert torch.equal(tensor, expected[name].to(torch.float16)), name


def test_converted_config_and_files():
    model_dir = smollm2_dir()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5 and config["tie_word_embeddings"]
    assert safetensors_files(model_dir) == [model_dir / "model.safetensors"]
    assert load_hf_config("smollm2") == config


@on_every_device
def test_sharded_safetensors_through_load_model(tmp_path, device):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=89,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    reference = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in reference.parameters():  # logits of a few units, so the tolerance below means something
            param.normal_(0.0, 0.2)
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(safetensors_files(tmp_path)) > 2
    model, hf_config, tokenizer = load_model(EngineConfig(model=str(tmp_path), device=device.type))
    assert tokenizer is None and hf_config["architectures"] == ["Qwen3ForCausalLM"]
    assert next(model.parameters()).dtype == torch.float16
    ids = [3, 14, 15, 92 % 89, 65, 35]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
        hidden = model(torch.tensor(ids, device=device), positions_for([6], device), DenseAttentionContext([6]))
        logits = model.compute_logits(hidden).cpu()
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(logits, expected, atol=1e-2, rtol=1e-2)  # fp16 weights vs the fp32 reference


SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 2,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}


@on_every_device
def test_dummy_weights_deterministic_and_realistic(tmp_path, device):
    (tmp_path / "config.json").write_text(json.dumps(SMALL_LLAMA))

    def load(seed):
        model, _, _ = load_model(EngineConfig(model=str(tmp_path), load_format="dummy", seed=seed, device=device.type))
        return {name: p.detach().float().cpu() for name, p in model.named_parameters()}

    first, again, other = load(3), load(3), load(4)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["embed_tokens.weight"], other["embed_tokens.weight"])
    weight = first["decoder_layers.1.mlp.gate_up_proj.weight"]
    assert abs(weight.std().item() - 0.02) < 0.001 and abs(weight.mean().item()) < 0.001
    assert torch.equal(first["decoder_layers.0.input_layernorm.weight"], torch.ones(576))


# Published parameter counts (model cards); ours counts embeddings and the untied LM head.
PARAMS = {"llama-3.1-8b": 8.03e9, "qwen3-8b": 8.19e9, "qwen3-30b-a3b": 30.53e9, "mixtral-8x7b": 46.70e9}


@pytest.mark.parametrize("name", BUILTIN_CONFIGS)
def test_builtin_configs_have_published_sizes(name):
    model = build_model(load_hf_config(name), dtype=torch.float16, device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / PARAMS[name] - 1) < 0.005, count


def test_unknown_model_and_weightless_builtin_raise():
    with pytest.raises(ConfigError, match="neither a directory"):
        load_model(EngineConfig(model="no-such-model", device="cpu"))
    with pytest.raises(ConfigError, match="dummy"):
        load_model(EngineConfig(model="qwen3-8b", device="cpu"))
