"""Weight sources: a HF directory of (sharded) safetensors, or deterministic random weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from elastiserve.engine.models import CausalLM, WeightLoadError

INDEX_FILE = "model.safetensors.index.json"
DUMMY_STD = 0.02
DUMMY_POOL = 1 << 22  # normals per pool half; windows of up to this length start anywhere in the first half


def safetensors_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / shard for shard in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files:
        raise WeightLoadError(f"{model_dir}: no safetensors weights found")
    if missing:
        raise WeightLoadError(f"{model_dir}: shards listed in {INDEX_FILE} are missing: {missing}")
    return files


def iter_safetensors(model_dir: Path, device: str | torch.device = "cpu", progress: bool = True) -> Iterator:
    """Yield (hf_name, tensor) shard by shard; only one tensor at a time is materialised beyond the model."""
    files = safetensors_files(model_dir)
    for path in tqdm(files, desc="loading shards", unit="shard", disable=not progress or len(files) < 2):
        with safe_open(str(path), framework="pt", device=str(device)) as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, shard.get_tensor(name)


def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights with a realistic scale: N(0, 0.02) for matrices, 1 for norm weights, 0 for biases.

    Deterministic for a given seed and independent of the device. Matrices are windows of one pool of normals
    drawn on the CPU, each chunk at a seeded random offset: drawing all 8e9 normals of an 8B model on the CPU took
    about a minute per engine on the H200 host, the pool takes a fraction of a second and the copies run on the device.
    """
    generator = torch.Generator().manual_seed(seed)
    pool = torch.empty(2 * DUMMY_POOL, dtype=torch.float32).normal_(0.0, DUMMY_STD, generator=generator)
    on_device: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            key = (param.device, param.dtype)
            if key not in on_device:
                on_device[key] = pool.to(device=param.device, dtype=param.dtype)
            _fill_from_pool(param.data, on_device[key], generator)


def _fill_from_pool(dest: torch.Tensor, pool: torch.Tensor, generator: torch.Generator) -> None:
    flat = dest.view(-1)
    for start in range(0, flat.numel(), DUMMY_POOL):
        piece = flat[start : start + DUMMY_POOL]
        offset = int(torch.randint(0, DUMMY_POOL, (1,), generator=generator))
        piece.copy_(pool[offset : offset + piece.numel()])
