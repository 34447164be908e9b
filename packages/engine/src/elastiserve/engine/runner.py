"""All device work of one engine process: KV pool, nested weights, inputs, attention, graphs, pair transfers, sampling.

The scheduler and the KV manager decide in plain Python; the runner turns one ``ScheduledBatch`` into buffers,
runs the model in the step's precision mode (``fast_layers``) and samples. Pair transitions run here too: demotion
packs pairs in place and ships the low bytes to host slots on a copy stream; promotion brings them back, unpacks
into two fresh blocks and reports the pair done only when its event has completed.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from elastiserve.engine.attention_context import AttentionMetadata, PagedAttentionContext, kernel_ops
from elastiserve.engine.config import EngineConfig
from elastiserve.engine.graphs import GraphRunner, graph_batch_sizes
from elastiserve.engine.kv_manager import BlockPool, DemoteOp, KVManager, PromoteOp, SumBlockPool
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import ScheduledBatch
from elastiserve.kernels.attention_plan import GENERAL, STRUCTURED, choose_path
from elastiserve.platforms import ConfigError

log = logging.getLogger(__name__)

TRANSFER_CHUNK_PAIRS = 16  # pairs per demote/promote staging round


@dataclass(slots=True)
class StepInputs:
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    pair_modes: list[list[int]] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)  # sequences whose chunk ends this step
    sample_params: list[SamplingParams] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class StepOutput:
    token_ids: list[int | None]  # one per scheduled sequence; None when its chunk did not reach the end


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.model_config = model.config
        self.block_size = config.block_size
        self.ops = kernel_ops(device)
        self.nested = nest_weights(model) if config.uses_nested_weights else None
        self.fast_layers: frozenset[int] = frozenset()
        self.forced_fast_layers: frozenset[int] = frozenset()  # pinned by tests and demos
        self.pool = create_kv_pool(config, model, device, self.nested)
        self.kv_cache = self.pool.kv_cache
        self.block_elems = self.kv_cache[0].numel()
        self.host_backing = self._create_host_backing()
        self.max_blocks = math.ceil(self.max_model_len / self.block_size) + 1
        self._allocate_buffers()
        scale = 1.0 / math.sqrt(self.model_config.head_dim)
        self.ctx = PagedAttentionContext(self.kv_cache, scale, self.ops)
        self.sampler = make_sampler()
        self.generators: dict[str, torch.Generator] = {}
        self._inflight_promotions: list[tuple[list[PromoteOp], object]] = []
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._demote_copy_done: object | None = None
        use_graphs = device.type == "cuda" and not config.enforce_eager
        self.graphs = GraphRunner(self, graph_batch_sizes(config.max_num_seqs)) if use_graphs else None

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len or self.model_config.max_position_embeddings

    @property
    def num_kv_blocks(self) -> int:
        return self.pool.block_pool.num_blocks

    # ---- setup -----------------------------------------------------------------------------------------------
    def _create_host_backing(self) -> torch.Tensor:
        """One slot per demotable pair: the low bytes of both blocks, i.e. one block's bytes."""
        slot_bytes = 2 * self.block_elems
        if not self.config.uses_kv_demotion:
            num_slots = 0
        elif self.config.host_backing_bytes is not None:
            num_slots = self.config.host_backing_bytes // slot_bytes
        else:
            num_slots = self.num_kv_blocks // 2 + 1  # every pair of the pool could be BASE
        pin = self.device.type == "cuda"
        return torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin)

    def _allocate_buffers(self) -> None:
        """Preallocated inputs: eager steps use prefixes, CUDA graphs capture the same storage."""
        t, b = self.config.max_num_batched_tokens, self.config.max_num_seqs
        max_pairs = math.ceil(self.max_blocks / 2)
        dev = self.device
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((b, self.max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        self.base_bounds = torch.zeros((b, 2), dtype=torch.int32, device=dev)
        self.pair_mode = torch.zeros((b, max_pairs), dtype=torch.uint8, device=dev)

    # ---- precision mode --------------------------------------------------------------------------------------
    def set_fast_layers(self, fast_layers: frozenset[int]) -> None:
        """Switch layers between full and fast between steps; the step's graph is chosen by this set."""
        if fast_layers == self.fast_layers:
            return
        if fast_layers and self.nested is None:
            raise RuntimeError("fast mode needs nested weights (policy static-fp8, dps or combined)")
        if self.nested is not None:
            set_layer_modes(self.model, fast_layers)
        self.fast_layers = fast_layers

    # ---- one step --------------------------------------------------------------------------------------------
    @staticmethod
    def step_inputs(batch: ScheduledBatch, kv: KVManager) -> StepInputs:
        """Everything the device needs for one step, as plain lists (what tensor parallelism broadcasts)."""
        bs = kv.block_size
        inputs = StepInputs()
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            inputs.tokens.extend(seq.token_ids[start : start + n])
            inputs.positions.extend(range(start, start + n))
            inputs.slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
            inputs.query_lens.append(n)
            inputs.seq_lens.append(start + n)
            inputs.block_tables.append(list(seq.block_table))
            inputs.pair_modes.append(kv.pair_modes(seq))
            if batch.samples(i):
                inputs.sample_indices.append(i)
                inputs.sample_params.append(seq.params)
                inputs.request_ids.append(seq.request_id)
        return inputs

    def load_inputs(self, inputs: StepInputs, padded_batch: int | None = None) -> AttentionMetadata:
        """Fill the preallocated buffers; ``padded_batch`` pads a decode batch to a captured graph size."""
        num_seqs = len(inputs.seq_lens)
        padded = padded_batch or num_seqs
        pad = padded - num_seqs  # graph padding: one dummy token per row, reading block 0, writing nowhere
        qsl = [0]
        for n in inputs.query_lens + [1] * pad:
            qsl.append(qsl[-1] + n)
        self._fill(self.input_ids, inputs.tokens + [0] * pad)
        self._fill(self.positions, inputs.positions + [0] * pad)
        self._fill(self.slot_mapping, inputs.slots + [-1] * pad)
        self._fill(self.query_start_loc, qsl)
        self._fill(self.seq_lens, inputs.seq_lens + [1] * pad)
        table = torch.zeros((padded, self.max_blocks), dtype=torch.int32)
        for i, row in enumerate(inputs.block_tables):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        self.block_tables[:padded].copy_(table, non_blocking=True)
        path, bounds = choose_path(inputs.pair_modes)
        if path == STRUCTURED:
            rows = bounds + [(0, 0)] * pad
            self.base_bounds[:padded].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        elif path == GENERAL:
            modes = torch.zeros((padded, self.pair_mode.shape[1]), dtype=torch.uint8)
            for i, row in enumerate(inputs.pair_modes):
                modes[i, : len(row)] = torch.tensor(row, dtype=torch.uint8)
            self.pair_mode[:padded].copy_(modes, non_blocking=True)
        return self.metadata_view(qsl[-1], padded, max(inputs.query_lens), path)

    def metadata_view(self, num_tokens: int, num_seqs: int, max_query_len: int, path: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_seqs],
            seq_lens=self.seq_lens[:num_seqs],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            max_query_len=max_query_len,
            path=path,
            base_bounds=self.base_bounds[:num_seqs] if path == STRUCTURED else None,
            pair_mode=self.pair_mode[:num_seqs] if path == GENERAL else None,
        )

    def _fill(self, buffer: torch.Tensor, values: list[int]) -> None:
        buffer[: len(values)].copy_(torch.tensor(values, dtype=buffer.dtype), non_blocking=True)

    def forward(self, num_tokens: int, metadata: AttentionMetadata) -> torch.Tensor:
        self.ctx.metadata = metadata
        return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens], self.ctx)

    def execute(self, batch: ScheduledBatch, kv: KVManager) -> StepOutput:
        """Run one scheduled step in the current mode; return a token for every sequence that samples."""
        return self.run(self.step_inputs(batch, kv))

    @torch.inference_mode()
    def run(self, inputs: StepInputs, sample: bool = True) -> StepOutput:
        num_seqs = len(inputs.seq_lens)
        is_decode = all(n == 1 for n in inputs.query_lens)
        padded = self.graphs.padded_size(num_seqs, is_decode) if self.graphs is not None else None
        if padded is not None:
            metadata = self.load_inputs(inputs, padded_batch=padded)
            hidden = self.graphs.get(padded, metadata.path).replay()[:num_seqs]
            last_rows = torch.arange(num_seqs, device=self.device)
        else:
            metadata = self.load_inputs(inputs)
            hidden = self.forward(metadata.slot_mapping.shape[0], metadata)
            last_rows = metadata.query_start_loc[1:] - 1
        out: list[int | None] = [None] * num_seqs
        if not inputs.sample_indices:
            return StepOutput(out)
        logits = self.model.compute_logits(hidden[last_rows[inputs.sample_indices]])
        if not sample:  # tensor-parallel workers: rank 0 samples
            return StepOutput(out)
        generators = [self._generator(r, p) for r, p in zip(inputs.request_ids, inputs.sample_params)]
        sampled = self.sampler(logits, inputs.sample_params, generators).tolist()
        for i, token in zip(inputs.sample_indices, sampled):
            out[i] = int(token)
        return StepOutput(out)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self.generators[request_id] = gen
        return gen

    def release_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    # ---- pair transitions ------------------------------------------------------------------------------------
    def demote(self, ops: list[DemoteOp]) -> None:
        """Pack pairs in place and move their low bytes to host slots (on a copy stream on a GPU)."""
        for i in range(0, len(ops), TRANSFER_CHUNK_PAIRS):
            chunk = ops[i : i + TRANSFER_CHUNK_PAIRS]
            a = torch.tensor([op.block_a for op in chunk], dtype=torch.int64, device=self.device)
            b = torch.tensor([op.block_b for op in chunk], dtype=torch.int64, device=self.device)
            slots = torch.tensor([op.slot for op in chunk], dtype=torch.int64)
            if self._copy_stream is None:
                low = torch.empty((len(chunk), 2 * self.block_elems), dtype=torch.uint8)
                self.ops.kv_demote(self.kv_cache, a, b, low)
                self.host_backing[slots] = low
                continue
            staging = self._staging()[: len(chunk)]
            if self._demote_copy_done is not None:
                torch.cuda.current_stream().wait_event(self._demote_copy_done)  # staging is free again
            self.ops.kv_demote(self.kv_cache, a, b, staging)
            packed = torch.cuda.Event()
            packed.record()
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(packed)
                for row, op in enumerate(chunk):
                    self.host_backing[op.slot].copy_(staging[row], non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self._demote_copy_done = done

    def _staging(self) -> torch.Tensor:
        if not hasattr(self, "_staging_buffer"):
            shape = (TRANSFER_CHUNK_PAIRS, 2 * self.block_elems)
            self._staging_buffer = torch.empty(shape, dtype=torch.uint8, device=self.device)
        return self._staging_buffer

    def start_promote(self, ops: list[PromoteOp]) -> None:
        """Copy low bytes back and unpack into the reserved blocks; ``poll_promotions`` reports completion."""
        for i in range(0, len(ops), TRANSFER_CHUNK_PAIRS):
            chunk = ops[i : i + TRANSFER_CHUNK_PAIRS]
            packed = torch.tensor([op.packed_block for op in chunk], dtype=torch.int64, device=self.device)
            dst_a = torch.tensor([op.dst_a for op in chunk], dtype=torch.int64, device=self.device)
            dst_b = torch.tensor([op.dst_b for op in chunk], dtype=torch.int64, device=self.device)
            slots = torch.tensor([op.slot for op in chunk], dtype=torch.int64)
            if self._copy_stream is None:
                self.ops.kv_promote(self.kv_cache, packed, dst_a, dst_b, self.host_backing[slots].contiguous())
                self._inflight_promotions.append((chunk, None))
                continue
            staging = torch.empty((len(chunk), 2 * self.block_elems), dtype=torch.uint8, device=self.device)
            self._copy_stream.wait_stream(torch.cuda.current_stream())  # staging's memory may be in use until now
            with torch.cuda.stream(self._copy_stream):
                for row, op in enumerate(chunk):
                    staging[row].copy_(self.host_backing[op.slot], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
            # The unpack runs on the compute stream, so any later reuse of the packed block is ordered after it.
            torch.cuda.current_stream().wait_event(copied)
            staging.record_stream(torch.cuda.current_stream())
            self.ops.kv_promote(self.kv_cache, packed, dst_a, dst_b, staging)
            done = torch.cuda.Event()
            done.record()
            self._inflight_promotions.append((chunk, done))

    def poll_promotions(self) -> list[PromoteOp]:
        """Promotions whose copy + unpack completed (their blocks may now be published)."""
        finished, pending = [], []
        for chunk, event in self._inflight_promotions:
            (finished if event is None or event.query() else pending).append((chunk, event))
        self._inflight_promotions = pending
        return [op for chunk, _ in finished for op in chunk]

    def evict_layers(self, layers: list[int]) -> None:
        """Hand the residual units of ``layers`` to KV (their layers run fast from the next step on)."""
        self.pool.manager.evict_layers(layers)

    def capture_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.capture_common()

    def between_steps(self, restore_layers: tuple[int, ...] | None) -> Any:
        """Commit finished residual restores; with ``restore_layers`` (``()`` = any) start restoring stale ones."""
        restore = restore_layers is not None
        return self.pool.manager.between_steps(restore=restore, restore_layers=restore_layers or None)

    def transfers_in_flight(self) -> int:
        return sum(len(chunk) for chunk, _ in self._inflight_promotions)


# ---- seams to the other packages (kept thin so integration changes stay here) ----------------------------------
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

    backend = open_backend("auto", device)
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


def nest_weights(model: torch.nn.Module) -> Any:
    from elastiserve.engine import nested_weights  # Triton kernels: imported only by nested-weight policies

    return nested_weights.nest_weights(model)


def set_layer_modes(model: torch.nn.Module, fast_layers: frozenset[int]) -> None:
    from elastiserve.engine import nested_weights

    nested_weights.set_layer_modes(model, fast_layers)


def layer_lower_planes(model: torch.nn.Module) -> dict[int, list[Any]]:
    from elastiserve.engine import nested_weights

    return nested_weights.layer_lower_planes(model)


def make_sampler() -> Any:
    try:
        from elastiserve.engine.sampler import Sampler
    except ImportError:
        return _greedy_or_multinomial
    return Sampler()


def _greedy_or_multinomial(logits: torch.Tensor, params: list, generators: list) -> torch.Tensor:
    """Stand-in until the model helper's Sampler lands: greedy, or plain temperature sampling."""
    out = logits.argmax(dim=-1)
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature > 0:
            probs = torch.softmax(logits[i] / p.temperature, dim=-1)
            out[i] = torch.multinomial(probs, 1, generator=gen)[0]
    return out
