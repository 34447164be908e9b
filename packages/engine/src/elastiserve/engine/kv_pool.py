"""The KV pool of one device: its size, and the SUM manager whose shared region holds the KV blocks and, with
nested weights, each decoder layer's residual (the lower planes of its linears and MoE experts).

At startup the lower planes move to a host backup, their device buffers are released, the shared region is created
in that memory, and each layer's nested modules get their ``lower`` pointed at slices of the layer's residual range.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from elastiserve.engine.block_pool import BlockPool, SumBlockPool
from elastiserve.engine.config import EngineConfig
from elastiserve.platforms import ConfigError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KVPool:
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim] fp16
    block_pool: BlockPool
    manager: Any = None  # elastiserve.memory's SUM manager when the residual planes live in the shared region


def kv_block_bytes(model_config: Any, block_size: int) -> int:
    mc = model_config
    return mc.num_hidden_layers * 2 * mc.num_key_value_heads * block_size * mc.head_dim * 2


def kv_pool_bytes(config: EngineConfig, model: torch.nn.Module, device: torch.device) -> int:
    """Bytes for the KV pool: an explicit budget, else what the memory budget leaves after weights and activations."""
    block_bytes = kv_block_bytes(model.config, config.block_size)
    if config.kv_cache_budget is not None:
        return config.kv_cache_budget
    if device.type == "cpu":
        return config.cpu_kv_blocks * block_bytes
    free, total = torch.cuda.mem_get_info(device)
    cap = total * config.gpu_memory_utilization
    if config.gpu_memory_budget is not None:
        cap = min(cap, config.gpu_memory_budget)
    used = total - free  # weights, the CUDA context and anything else already resident
    mc = model.config
    tokens = config.max_num_batched_tokens
    # Peak activations of one step (fp16): hidden states and the widest projection outputs, plus fp32 logits.
    activation = tokens * 2 * (4 * mc.hidden_size + 3 * max(mc.intermediate_size, mc.q_size + 2 * mc.kv_size))
    activation += config.max_num_seqs * mc.vocab_size * 4 * 2
    if config.mixed_graphs:  # the graphs' private pool holds a step's activations beside the eager steps' cache
        activation *= 2
    kv_bytes = _agree_across_ranks(int(cap - used - activation))
    if kv_bytes < 2 * block_bytes:
        raise ConfigError(f"the memory budget leaves {kv_bytes / 2**20:.0f} MiB for the KV cache: too little")
    return kv_bytes


def _agree_across_ranks(value: int) -> int:
    """Tensor-parallel ranks must size identical pools (their Algorithm 1 books replay rank 0's): take the minimum."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def create_kv_pool(config: EngineConfig, model: torch.nn.Module, device: torch.device, nested: Any) -> KVPool:
    """The SUM manager over the platform's VMM back-end: the KV tensor is its KV range; with nested weights each
    decoder layer's lower planes (linears and MoE experts) move into that layer's residual range (bytes copied in
    by the one-shot path)."""
    from elastiserve.memory.sum_manager import SumConfig, SumManager, choose_unit_bytes
    from elastiserve.memory.vmm import open_backend

    backend = open_backend("host" if device.type == "cpu" else "auto", device)  # a CPU engine on a GPU host too
    block_bytes = kv_block_bytes(model.config, config.block_size)
    granularity = backend.granularity()
    # GPUs: 2 MiB-ish units. The host's 4 KiB pages would waste blocks at unit edges; a few blocks per unit fixes it.
    target = 2 * 2**20 if device.type == "cuda" else 16 * max(block_bytes, granularity)
    unit_bytes = choose_unit_bytes(block_bytes, granularity, target)
    residuals = layer_lower_planes(model) if nested is not None else {}
    residual_bytes = {layer: sum(m.upper.numel() for m in mods) for layer, mods in residuals.items()}
    residual_units = sum(-(-n // unit_bytes) for n in residual_bytes.values())
    pool_bytes = kv_pool_bytes(config, model, device)
    backup = move_lower_planes_to_host(residuals, device) if residuals else None
    if device.type == "cuda":
        pool_bytes += sum(residual_bytes.values())  # the lower planes' device buffers were just released
    # A device budget is a ceiling (round down); the CPU's block count is a request (round up).
    kv_units = -(-pool_bytes // unit_bytes) if device.type == "cpu" else pool_bytes // unit_bytes
    kv_units = max(1, kv_units - (residual_units if device.type == "cuda" else 0))
    manager = SumManager(backend, SumConfig(kv_units + residual_units, unit_bytes, block_bytes))
    mc = model.config
    shape = (manager.num_blocks, mc.num_hidden_layers, 2, mc.num_key_value_heads, config.block_size, mc.head_dim)
    kv_cache = manager.kv_view(torch.float16, shape)
    if backup is not None:
        bind_residuals(manager, residuals, backup)
    log.info("KV pool: %d blocks in %d units of %d KiB (%d units hold residuals)", manager.num_blocks,
             kv_units + residual_units, unit_bytes // 1024, residual_units)
    return KVPool(kv_cache, SumBlockPool(manager.state), manager)


def move_lower_planes_to_host(residuals: dict[int, list[Any]], device: torch.device) -> Any:
    """Keep each layer's lower bytes (module order) in a host backup and release their device buffers, so the
    shared region can be created in the memory they held."""
    from elastiserve.memory.residual_backup import ResidualBackup

    backup = ResidualBackup(device)
    for layer, mods in residuals.items():
        backup.add(layer, torch.cat([m.lower.reshape(-1) for m in mods]))
        for m in mods:
            m.lower = torch.empty(0, dtype=torch.uint8, device=m.upper.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return backup


def bind_residuals(manager: Any, residuals: dict[int, list[Any]], backup: Any) -> None:
    """Give each layer a residual range, point its nested modules' ``lower`` at their slices of it, and copy the
    bytes in from the backup (the one-shot startup path)."""
    for layer, mods in residuals.items():
        view = manager.register_residual(layer, sum(m.upper.numel() for m in mods))
        offset = 0
        for m in mods:
            n = m.upper.numel()
            m.bind_lower(view[offset : offset + n].view(m.upper.shape))
            offset += n
    manager.attach_backup(backup)
    manager.load_residuals()


def layer_lower_planes(model: torch.nn.Module) -> dict[int, list[Any]]:
    from elastiserve.engine import nested_weights  # Triton kernels: imported only by nested-weight policies

    return nested_weights.layer_lower_planes(model)
