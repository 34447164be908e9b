"""The server's default sampling values: the model's ``generation_config.json``, as vLLM applies it by default
(``--generation-config auto``). Qwen3, for one, ships temperature 0.6, top-p 0.95 and top-k 20 there, and its
authors warn that greedy decoding makes it repeat itself; a request's own values win over these.

Only the fields vLLM takes are read (temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as the
default max_tokens, capped at what the context leaves); ``do_sample`` is not, as in vLLM. ``--generation-config
none`` keeps OpenAI's defaults; a path names another folder or file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from elastiserve.engine.errors import InvalidRequest
from elastiserve.engine.sampling import SamplingParams
from elastiserve.platforms import ConfigError

FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # file field -> ours
INTEGER_FIELDS = ("top_k", "max_new_tokens")


def generation_defaults(source: str, model_dir: Path | None) -> dict[str, Any]:
    """The ``SamplingParams`` keyword defaults ``source`` gives: ``auto`` (the model folder's file, if it has
    one), ``none``, or a folder or file path (which must exist). Bad values raise ``ConfigError``."""
    if source == "none":
        return {}
    if source == "auto":
        if model_dir is None or not (model_dir / "generation_config.json").is_file():
            return {}
        path = model_dir / "generation_config.json"
    else:
        path = Path(source).expanduser()
        path = path / "generation_config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"--generation-config {source!r}: no such file (nor generation_config.json in it)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON: {exc}") from exc
    return parse_generation_config(config, str(path))


def parse_generation_config(config: Any, where: str = "generation config") -> dict[str, Any]:
    """Our defaults from a ``generation_config.json`` object (fields missing or null are left to ours)."""
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    defaults: dict[str, Any] = {}
    for name, ours in FIELDS.items():
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or (name in INTEGER_FIELDS and value != int(value)):
            raise ConfigError(f"{where}: {name} must be a {'whole' if name in INTEGER_FIELDS else 'finite'} number, "
                              f"got {value!r}")
        defaults[ours] = int(value) if name in INTEGER_FIELDS else float(value)
    if defaults.get("top_k") == 0:  # transformers' "no top-k"; ours is -1
        defaults["top_k"] = -1
    try:
        SamplingParams(**defaults).validate(vocab_size=2**31 - 1, max_model_len=2**62, prompt_len=1)
    except InvalidRequest as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return defaults
