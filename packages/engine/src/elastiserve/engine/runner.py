"""All device work of one engine process: KV pool, nested weights, inputs, attention, graphs, pair transfers, sampling.

The scheduler and the KV manager decide in plain Python; the runner turns one ``ScheduledBatch`` into buffers
(``step_inputs.py``), runs the model in the step's precision mode (``fast_layers``) and samples. The KV pool and the
weight residuals that share its memory are built in ``kv_pool.py``, the nested weights in ``nested_weights.py``.
Pair transitions run here: demotion packs pairs in place and ships the low bytes to host slots on a copy stream;
promotion brings them back, unpacks into two fresh blocks and reports the pair done only when its event has completed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from elastiserve.engine.attention_context import AttentionMetadata, PagedAttentionContext, kernel_ops
from elastiserve.engine.config import EngineConfig
from elastiserve.engine.errors import DemotionFailed, EngineError, PromotionFailed
from elastiserve.engine.graphs import (
    GraphRunner,
    StepShape,
    graph_batch_sizes,
    mixed_seq_buckets,
    mixed_token_buckets,
)
from elastiserve.engine.kv_manager import KVManager
from elastiserve.engine.kv_pool import create_kv_pool
from elastiserve.engine.outputs import TokenLogprob
from elastiserve.engine.pair_ops import DemoteOp, PromoteOp
from elastiserve.engine.sampler import Sampler
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import ScheduledBatch
from elastiserve.engine.step_inputs import InputBuffers, StepInputs, StepOutput, gather_step_inputs
from elastiserve.engine.warmup import WarmUpShape, attention_paths, graph_mode_sets, mode_sets, warm_up_shapes

__all__ = ["TRANSFER_CHUNK_PAIRS", "ModelRunner", "StepInputs", "StepOutput"]

TRANSFER_CHUNK_PAIRS = 16  # pairs per demote/promote staging round
log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.model_config = model.config
        self.block_size = config.block_size
        self.ops = kernel_ops(device)
        self.nested = nest_weights(model, config.nest_lm_head, config.lm_head_exact_top) \
            if config.uses_nested_weights else None
        self.fast_layers: frozenset[int] = frozenset()
        self.forced_fast_layers: frozenset[int] = frozenset()  # pinned by tests and demos
        self.pool = create_kv_pool(config, model, device, self.nested)
        self.kv_cache = self.pool.kv_cache
        self.block_elems = self.kv_cache[0].numel()
        self.host_backing = self._create_host_backing()
        self.max_blocks = math.ceil(self.max_model_len / self.block_size) + 1
        self.buffers = InputBuffers(config, self.max_blocks, device)
        scale = 1.0 / math.sqrt(self.model_config.head_dim)
        self.ctx = PagedAttentionContext(self.kv_cache, scale, self.ops)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self._inflight_promotions: list[tuple[list[PromoteOp], object]] = []
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._demote_copy_done: object | None = None
        # Host work that fits in the device's time on a step (the engine's garbage collection, gc_watch.py): called
        # once the step's forward is queued, before anything reads its results back.
        self.host_work_in_shadow: Callable[[], object] | None = None
        use_graphs = device.type == "cuda" and not config.enforce_eager
        mixed = (mixed_token_buckets(config.max_num_batched_tokens), mixed_seq_buckets(config.max_num_seqs)) \
            if config.mixed_graphs else None
        self.graphs = GraphRunner(self, graph_batch_sizes(config.max_num_seqs), config.graph_capture_after,
                                  mixed) if use_graphs else None

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
            # Every block can end up holding a BASE pair (a freed block is refilled and demoted in turn), so the
            # default is one slot per block: the pool's bytes. Half that (one per initial pair) ran out in the
            # quarter-scale dense elastickv run on the H200 and preempted 255 times with demotable pairs left.
            num_slots = self.num_kv_blocks
        pin = self.device.type == "cuda"
        return torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin)

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
        return gather_step_inputs(batch, kv)

    def load_inputs(self, inputs: StepInputs, shape: StepShape | None = None) -> AttentionMetadata:
        """Fill the preallocated buffers; ``shape`` pads the step to a captured graph's (``GraphRunner.step_shape``)."""
        if shape is None:
            return self.buffers.load(inputs)
        return self.buffers.load(inputs, padded_batch=shape.batch, padded_tokens=shape.tokens if shape.mixed else None)

    def forward(self, num_tokens: int, metadata: AttentionMetadata) -> torch.Tensor:
        self.ctx.metadata = metadata
        return self.model(self.buffers.input_ids[:num_tokens], self.buffers.positions[:num_tokens], self.ctx)

    def execute(self, batch: ScheduledBatch, kv: KVManager) -> StepOutput:
        """Run one scheduled step in the current mode; return a token for every sequence that samples."""
        return self.run(self.step_inputs(batch, kv))

    @torch.inference_mode()
    def run(self, inputs: StepInputs, sample: bool = True) -> StepOutput:
        num_seqs = len(inputs.seq_lens)
        is_decode = all(n == 1 for n in inputs.query_lens)
        shape = self.graphs.step_shape(len(inputs.tokens), num_seqs, is_decode) if self.graphs is not None else None
        if shape is not None:
            metadata = self.load_inputs(inputs, shape)
            hidden = self.graphs.run(shape, metadata)
            last_rows = metadata.query_start_loc[1 : num_seqs + 1] - 1 if shape.mixed \
                else torch.arange(num_seqs, device=self.device)
        else:
            metadata = self.load_inputs(inputs)
            hidden = self.forward(metadata.slot_mapping.shape[0], metadata)
            last_rows = metadata.query_start_loc[1:] - 1
        if self.host_work_in_shadow is not None:  # the forward is queued: the host would only wait for the device
            self.host_work_in_shadow()
        out: list[int | None] = [None] * num_seqs
        if not sample:  # tensor-parallel workers: rank 0 computes logits and samples
            return StepOutput(out)
        prompt = score_prompt_rows(self.model, hidden, inputs.prompt_rows) if inputs.prompt_rows else None
        if not inputs.sample_indices:
            return StepOutput(out, prompt_logprobs=prompt)
        logits = self.model.compute_logits(hidden[last_rows[inputs.sample_indices]])
        generators = [self._generator(r, p) for r, p in zip(inputs.request_ids, inputs.sample_params)]
        sampled = self.sampler(logits, inputs.sample_params, generators, inputs.sample_histories, inputs.sample_bans,
                               inputs.sample_allowed)
        for i, token in zip(inputs.sample_indices, sampled.tolist()):
            out[i] = int(token)
        step = StepOutput(out, prompt_logprobs=prompt)
        if any(p.logprobs is not None for p in inputs.sample_params):
            step.logprobs = [None] * num_seqs
            for i, entry in zip(inputs.sample_indices, token_logprobs(logits, sampled, inputs.sample_params)):
                step.logprobs[i] = entry
        return step

    def synchronize(self) -> None:
        """Wait for the device's queued work (timing a step that samples nothing, ``step_probe``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
        self.sampler.release(request_id)

    # ---- pair transitions ------------------------------------------------------------------------------------
    def demote(self, ops: list[DemoteOp]) -> None:
        """Pack pairs in place and move their low bytes to host slots (on a copy stream on a GPU). A chunk that fails
        before its pack kernel is called raises ``DemotionFailed`` (its blocks are untouched); a failure after that
        may have packed blocks in place, cannot be undone, and raises ``EngineError``."""
        for i in range(0, len(ops), TRANSFER_CHUNK_PAIRS):
            chunk = ops[i : i + TRANSFER_CHUNK_PAIRS]
            try:
                inputs = self._demote_inputs(chunk)
            except Exception as exc:  # nothing written yet: the caller puts the rest back to TARGET
                raise DemotionFailed(ops[:i], ops[i:], exc) from exc
            try:
                self._pack_and_copy_out(chunk, *inputs)
            except Exception as exc:
                raise EngineError(f"demotion failed after packing blocks in place: {exc}") from exc

    def _demote_inputs(self, chunk: list[DemoteOp]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunk's A and B block indices and the buffer its low bytes go to (free to write once this returns)."""
        a = torch.tensor([op.block_a for op in chunk], dtype=torch.int64, device=self.device)
        b = torch.tensor([op.block_b for op in chunk], dtype=torch.int64, device=self.device)
        if self._copy_stream is None:
            return a, b, torch.empty((len(chunk), 2 * self.block_elems), dtype=torch.uint8)
        if self._demote_copy_done is not None:
            torch.cuda.current_stream().wait_event(self._demote_copy_done)  # staging is free again
        return a, b, self._staging()[: len(chunk)]

    def _pack_and_copy_out(self, chunk: list[DemoteOp], a: torch.Tensor, b: torch.Tensor, low: torch.Tensor) -> None:
        self.ops.kv_demote(self.kv_cache, a, b, low)
        if self._copy_stream is None:
            self.host_backing[torch.tensor([op.slot for op in chunk], dtype=torch.int64)] = low
            return
        packed = torch.cuda.Event()
        packed.record()
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(packed)
            for row, op in enumerate(chunk):
                self.host_backing[op.slot].copy_(low[row], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self._demote_copy_done = done

    def _staging(self) -> torch.Tensor:
        if not hasattr(self, "_staging_buffer"):
            shape = (TRANSFER_CHUNK_PAIRS, 2 * self.block_elems)
            self._staging_buffer = torch.empty(shape, dtype=torch.uint8, device=self.device)
        return self._staging_buffer

    def start_promote(self, ops: list[PromoteOp]) -> None:
        """Copy low bytes back and unpack into the reserved blocks; ``poll_promotions`` reports completion. A chunk
        that fails to start raises ``PromotionFailed`` with the ops already in flight and those that are not."""
        for i in range(0, len(ops), TRANSFER_CHUNK_PAIRS):
            try:
                self._start_promote_chunk(ops[i : i + TRANSFER_CHUNK_PAIRS])
            except Exception as exc:  # any failure: the caller puts the rest back to BASE
                raise PromotionFailed(ops[:i], ops[i:], exc) from exc

    def _start_promote_chunk(self, chunk: list[PromoteOp]) -> None:
        """One chunk's copy and unpack; its ops enter ``_inflight_promotions`` only once all of it is enqueued."""
        packed = torch.tensor([op.packed_block for op in chunk], dtype=torch.int64, device=self.device)
        dst_a = torch.tensor([op.dst_a for op in chunk], dtype=torch.int64, device=self.device)
        dst_b = torch.tensor([op.dst_b for op in chunk], dtype=torch.int64, device=self.device)
        if self._copy_stream is None:
            slots = torch.tensor([op.slot for op in chunk], dtype=torch.int64)
            self.ops.kv_promote(self.kv_cache, packed, dst_a, dst_b, self.host_backing[slots].contiguous())
            self._inflight_promotions.append((chunk, None))
            return
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

    def warm_up(self) -> None:
        """Before serving: run the pair-transfer kernels once, compile every step shape the policy reaches (GPU
        only: the CPU has nothing to compile), then capture the decode graphs (``capture_graphs``)."""
        if self.config.uses_kv_demotion:
            # Demote then promote block 0 onto itself (a pair of one block: the pack reads both halves before it
            # writes, the unpack restores it bit-exactly), so the first real demotion does not compile mid-run.
            block = torch.zeros(1, dtype=torch.int64, device=self.device)
            low = torch.empty((1, 2 * self.block_elems), dtype=torch.uint8, device=self.device)
            self.ops.kv_demote(self.kv_cache, block, block, low)
            self.ops.kv_promote(self.kv_cache, block, block, block, low)
        start = time.perf_counter()
        if self.device.type == "cuda":
            shapes = self.warm_up_shapes()
            self.run_warm_up_shapes(shapes)
            log.info("warm-up: %d step shapes compiled in %.1f s", len(shapes), time.perf_counter() - start)
            start = time.perf_counter()
            rows, tokens = self.warm_up_by_rows()
            log.info("warm-up: linears at %d row counts, MoE blocks at %s token counts in %.1f s", len(rows),
                     [len(counts) for counts in tokens], time.perf_counter() - start)
        start = time.perf_counter()
        self.capture_graphs()
        if self.graphs is not None:
            log.info("warm-up: %d graphs captured in %.1f s", len(self.graphs.graphs),
                     time.perf_counter() - start)

    def warm_up_shapes(self) -> list[WarmUpShape]:
        group = self.model_config.num_attention_heads // self.model_config.num_key_value_heads
        return warm_up_shapes(self.config, self.model_config.num_hidden_layers, group, self.max_model_len)

    def warm_up_by_rows(self) -> tuple[list[int], list[list[int]]]:
        """Each kind of linear and of MoE block alone, at every row (token) count where ``kernels.warm_rows`` finds a
        new kernel variant, up to the step's token budget, in each mode the policy runs (``engine.row_warmup`` says
        why). Returns the linears' row counts and each block kind's token counts."""
        from elastiserve.engine import row_warmup
        from elastiserve.kernels.warm_rows import grouped_launch_key, rows_to_warm

        budget = min(self.config.max_num_batched_tokens, self.max_model_len)
        linears = row_warmup.distinct_linears(self.model)
        rows = rows_to_warm(row_warmup.linear_shapes(linears), budget)
        blocks = row_warmup.distinct_moe_blocks(self.model)
        tokens = [rows_to_warm(row_warmup.expert_shapes(block), budget, key=grouped_launch_key) for block in blocks]
        before = self.fast_layers
        for fast_layers in mode_sets(self.config, self.model_config.num_hidden_layers):
            self.set_fast_layers(fast_layers)
            row_warmup.warm_up_linears(linears, rows, self.device)
            for block, counts in zip(blocks, tokens, strict=True):
                row_warmup.warm_up_moe_block(block, counts, self.device)
        self.set_fast_layers(before)
        return rows, tokens

    @torch.inference_mode()
    def run_warm_up_shapes(self, shapes: list[WarmUpShape]) -> None:
        """Eager forwards of one sequence each that write no KV (slots -1) and read block 0 only."""
        before = self.fast_layers
        for shape in shapes:
            self.set_fast_layers(shape.fast_layers)
            self.buffers.reset_for_prefill(shape.query_len)
            self.forward(shape.query_len, self.buffers.metadata_view(shape.query_len, 1, shape.query_len, shape.path))
        self.set_fast_layers(before)

    def capture_graphs(self) -> None:
        """Capture, before serving, the graphs the policy reaches without per-layer mixes: every decode batch size
        on each attention path the policy uses (and every mixed bucket on the native path, with ``mixed_graphs``),
        in each of its whole-model modes and, per layer, each prefix of whole layer groups
        (``warmup.graph_mode_sets``). A graph first met mid-run (a mix of groups out of order) is captured, and its
        kernels compiled, inside somebody's step."""
        if self.graphs is None:
            return
        before = self.fast_layers
        num_layers = self.model_config.num_hidden_layers
        whole_model = mode_sets(self.config, num_layers)  # captured first, with warm-up forwards
        mixes = [s for s in graph_mode_sets(self.config, num_layers) if s not in whole_model]
        for fast_layers in [*whole_model, *mixes]:
            self.set_fast_layers(fast_layers)
            self.graphs.capture_common(attention_paths(self.config), warm_up=fast_layers in whole_model)
        self.set_fast_layers(before)

    def between_steps(self, restore_layers: tuple[int, ...] | None) -> Any:
        """Commit finished residual restores; with ``restore_layers`` (``()`` = any) start restoring stale ones."""
        restore = restore_layers is not None
        return self.pool.manager.between_steps(restore=restore, restore_layers=restore_layers or None)

    def transfers_in_flight(self) -> int:
        return sum(len(chunk) for chunk, _ in self._inflight_promotions)


# ---- seams to the other packages (kept thin so integration changes stay here) ----------------------------------
def nest_weights(model: torch.nn.Module, lm_head: bool, exact_top: int) -> Any:
    from elastiserve.engine import nested_weights  # Triton kernels: imported only by nested-weight policies

    return nested_weights.nest_weights(model, lm_head=lm_head, exact_top=exact_top)


def token_logprobs(logits: torch.Tensor, sampled: torch.Tensor, params: list[SamplingParams]) -> list[Any]:
    """Per row, None or the sampled token's raw log-probability and the row's ``logprobs`` most likely tokens; the
    rows that ask are computed together, and read back once."""
    rows = [j for j, p in enumerate(params) if p.logprobs is not None]
    index = torch.tensor(rows, device=logits.device)
    entries = rank_tokens(torch.log_softmax(logits[index].float(), dim=-1), sampled[index],
                          [params[j].logprobs for j in rows])
    out: list[Any] = [None] * len(params)
    for j, entry in zip(rows, entries):
        out[j] = entry
    return out


PROMPT_SCORE_ROWS = 256  # prompt rows scored per logits call: 256 x a 128k vocabulary is 128 MiB of fp32


def score_prompt_rows(model: Any, hidden: torch.Tensor, prompt_rows: list) -> dict[int, list[TokenLogprob]]:
    """For each (sequence, first row, targets, alternatives): the raw logprob of every target given the row before
    it, in slices so that a long chunk does not materialise its whole [rows, vocabulary] logits at once."""
    scored: dict[int, list[TokenLogprob]] = {}
    for seq_index, first_row, targets, width in prompt_rows:
        entries = scored.setdefault(seq_index, [])
        for s in range(0, len(targets), PROMPT_SCORE_ROWS):
            part = targets[s : s + PROMPT_SCORE_ROWS]
            rows = hidden[first_row + s : first_row + s + len(part)]
            logp = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)
            ids = torch.tensor(part, dtype=torch.int64, device=hidden.device)
            entries += rank_tokens(logp, ids, [width] * len(part))
    return scored


def rank_tokens(logp: torch.Tensor, ids: torch.Tensor, widths: list[int]) -> list[TokenLogprob]:
    """Row k: ``ids[k]``'s logprob in ``logp[k]`` and the row's ``widths[k]`` most likely tokens, read back once."""
    chosen = logp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    width = max(widths)
    top_lp, top_ids = logp.topk(width, dim=-1) if width else (logp[:, :0], logp[:, :0].long())
    top_lp, top_ids, ids = top_lp.tolist(), top_ids.tolist(), ids.tolist()
    return [TokenLogprob(ids[k], chosen[k], tuple(zip(top_ids[k][:n], top_lp[k][:n]))) for k, n in enumerate(widths)]


def set_layer_modes(model: torch.nn.Module, fast_layers: frozenset[int]) -> None:
    from elastiserve.engine import nested_weights

    nested_weights.set_layer_modes(model, fast_layers)
