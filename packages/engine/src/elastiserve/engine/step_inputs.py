"""One step's inputs: plain lists gathered from the scheduled batch (what tensor parallelism broadcasts), and the
preallocated device buffers they are copied into (eager steps use prefixes, CUDA graphs capture the same storage).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from elastiserve.engine.attention_context import AttentionMetadata
from elastiserve.engine.config import EngineConfig
from elastiserve.engine.kv_manager import KVManager
from elastiserve.engine.outputs import TokenLogprob
from elastiserve.engine.sampler import PenaltyHistory
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import ScheduledBatch
from elastiserve.kernels.attention_plan import GENERAL, STRUCTURED, STRUCTURED_SPLIT, choose_path_from_bounds


@dataclass(slots=True)
class StepInputs:
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[Seq[int]] = field(default_factory=list)  # int32 rows (BlockTable.row) or lists
    base_bounds: list[tuple[int, int] | None] = field(default_factory=list)  # KVManager.base_bounds per sequence
    pair_modes: dict[int, list[int]] = field(default_factory=dict)  # row -> KVManager.pair_modes where bounds are None
    sample_indices: list[int] = field(default_factory=list)  # sequences whose chunk ends this step
    sample_params: list[SamplingParams] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    # the tokens of sampling sequences whose params have penalties (by reference); None for the others
    sample_histories: list[PenaltyHistory | None] = field(default_factory=list)
    # per sampling sequence: token ids it may not pick this step (EOS and stop tokens before min_tokens)
    sample_bans: list[tuple[int, ...]] = field(default_factory=list)
    # per sampling sequence: its guide's mask of allowed tokens (bytes of 0/1 per token id), None when unguided
    sample_allowed: list[bytearray | None] = field(default_factory=list)
    # (sequence, its first row in this step, the prompt tokens those rows predict, alternatives) for sequences that
    # asked for prompt logprobs and have prompt tokens left to score
    prompt_rows: list[tuple[int, int, list[int], int]] = field(default_factory=list)


@dataclass(slots=True)
class StepOutput:
    token_ids: list[int | None]  # one per scheduled sequence; None when its chunk did not reach the end
    logprobs: list[TokenLogprob | None] | None = None  # likewise, for sequences that asked for logprobs
    prompt_logprobs: dict[int, list[TokenLogprob]] | None = None  # sequence index -> the prompt tokens scored


def gather_step_inputs(batch: ScheduledBatch, kv: KVManager) -> StepInputs:
    """Everything the device needs for one step, as plain lists (what tensor parallelism broadcasts)."""
    bs = kv.block_size
    inputs = StepInputs()
    tokens, positions, slots = inputs.tokens, inputs.positions, inputs.slots
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        if n == 1 and seq.prompt_logprobs is None:  # a decode row: no slices or generators (batch 256 on the CPU)
            tokens.append(seq.token_ids[start])
            positions.append(start)
            slots.append(seq.block_table[start // bs] * bs + start % bs)
        else:
            if seq.prompt_logprobs is not None:  # rows p predict token p + 1; skip what an earlier pass scored
                first, stop = max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)
                if first < stop:
                    inputs.prompt_rows.append((i, len(tokens) + first - start, seq.token_ids[first + 1 : stop + 1],
                                               seq.params.prompt_logprobs))
            tokens.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
        inputs.query_lens.append(n)
        inputs.seq_lens.append(start + n)
        inputs.block_tables.append(seq.block_table.row())  # int32, only changed entries copied (block_table.py)
        bounds = kv.base_bounds(seq)
        inputs.base_bounds.append(bounds)
        if bounds is None:  # BASE pairs in several runs: the general path reads them pair by pair
            inputs.pair_modes[i] = kv.pair_modes(seq)
        if batch.samples(i):
            inputs.sample_indices.append(i)
            inputs.sample_params.append(seq.params)
            inputs.request_ids.append(seq.request_id)
            inputs.sample_histories.append(
                PenaltyHistory(seq.request_id, seq.token_ids, seq.num_prompt_tokens, seq.output_token_ids)
                if seq.params.has_penalties else None)
            inputs.sample_bans.append(seq.banned_before_min if seq.num_output_tokens < seq.params.min_tokens
                                      else ())
            inputs.sample_allowed.append(None if seq.guide is None else seq.guide.allowed())
    return inputs


def forward_inputs(inputs: StepInputs) -> StepInputs:
    """What a tensor-parallel worker needs of a step: the forward's inputs. Workers never sample or score (rank 0
    does), so the sampling fields stay out of the broadcast: a penalised request's history is its whole token list,
    and a request scoring its prompt carries the prompt's tokens. With 64 penalised decode rows of 4,000-token
    prompts and 500 outputs, the step's pickled plan is 1.02 MB and takes 7.6 ms to pickle on this project's CPU;
    without those fields 55 KB and 0.5 ms."""
    return dataclasses.replace(inputs, sample_params=[], request_ids=[], sample_histories=[], sample_bans=[],
                               sample_allowed=[], prompt_rows=[])


class InputBuffers:
    """Preallocated inputs: eager steps use prefixes, CUDA graphs capture the same storage."""

    def __init__(self, config: EngineConfig, max_blocks: int, device: torch.device) -> None:
        t, b = config.max_num_batched_tokens, config.max_num_seqs
        max_pairs = math.ceil(max_blocks / 2)
        self.max_blocks = max_blocks
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((b, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(b + 1, dtype=torch.int32, device=device)
        self.base_bounds = torch.zeros((b, 2), dtype=torch.int32, device=device)
        self.pair_mode = torch.zeros((b, max_pairs), dtype=torch.uint8, device=device)

    def load(self, inputs: StepInputs, padded_batch: int | None = None,
             padded_tokens: int | None = None) -> AttentionMetadata:
        """Fill the buffers; ``padded_batch`` pads a decode batch to a captured graph size. With ``padded_tokens``
        (a mixed graph, graphs.py) padding rows have no queries and the tokens past the real ones belong to no
        sequence; the attention grid is then sized for ``padded_tokens`` queries."""
        num_seqs = len(inputs.seq_lens)
        padded = padded_batch or num_seqs
        pad = padded - num_seqs
        # Decode graph padding: one dummy token per row, reading block 0, writing nowhere. Mixed: none.
        row_tokens = 1 if padded_tokens is None else 0
        qsl = [0]
        for n in inputs.query_lens + [row_tokens] * pad:
            qsl.append(qsl[-1] + n)
        extra = pad * row_tokens if padded_tokens is None else padded_tokens - qsl[-1]
        if extra < 0:
            raise ValueError(f"{qsl[-1]} tokens do not fit a step padded to {padded_tokens}")
        _fill(self.input_ids, inputs.tokens + [0] * extra)
        _fill(self.positions, inputs.positions + [0] * extra)
        _fill(self.slot_mapping, inputs.slots + [-1] * extra)
        _fill(self.query_start_loc, qsl)
        _fill(self.seq_lens, inputs.seq_lens + [row_tokens] * pad)
        self.block_tables[:padded].copy_(torch.from_numpy(block_table_array(inputs.block_tables, padded,
                                                                            self.max_blocks)), non_blocking=True)
        path, bounds = choose_path_from_bounds(inputs.base_bounds)
        if path in (STRUCTURED, STRUCTURED_SPLIT):
            rows = bounds + [(0, 0)] * pad
            self.base_bounds[:padded].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        elif path == GENERAL:
            modes = torch.zeros((padded, self.pair_mode.shape[1]), dtype=torch.uint8)
            for i, run in enumerate(inputs.base_bounds):
                if run is None:
                    modes[i, : len(inputs.pair_modes[i])] = torch.tensor(inputs.pair_modes[i], dtype=torch.uint8)
                else:
                    modes[i, run[0] : run[1]] = 1
            self.pair_mode[:padded].copy_(modes, non_blocking=True)
        if padded_tokens is not None:
            return self.metadata_view(padded_tokens, padded, padded_tokens, path, padded=True)
        return self.metadata_view(qsl[-1], padded, max(inputs.query_lens), path)

    def metadata_view(self, num_tokens: int, num_seqs: int, max_query_len: int, path: int,
                      padded: bool = False) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_seqs],
            seq_lens=self.seq_lens[:num_seqs],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            max_query_len=max_query_len,
            path=path,
            base_bounds=self.base_bounds[:num_seqs] if path in (STRUCTURED, STRUCTURED_SPLIT) else None,
            pair_mode=self.pair_mode[:num_seqs] if path == GENERAL else None,
            padded=padded,
        )

    def reset_for_prefill(self, query_len: int) -> None:
        """Inputs of one sequence of ``query_len`` new tokens that write nothing and read block 0 (warm-up)."""
        self.slot_mapping[:query_len].fill_(-1)
        self.input_ids[:query_len].zero_()
        self.positions[:query_len].copy_(torch.arange(query_len))
        self.seq_lens[:1].fill_(query_len)
        self.query_start_loc[:2].copy_(torch.tensor([0, query_len], dtype=torch.int32))
        self.block_tables[:1].zero_()
        self.base_bounds[:1].zero_()
        self.pair_mode[:1].zero_()

    def reset_for_capture(self, num_tokens: int, num_seqs: int) -> None:
        """Inputs that write nothing, for capturing a graph of ``num_tokens`` rows and ``num_seqs`` sequences: one
        token per sequence reading block 0; the tokens past them (a mixed graph's) belong to no sequence."""
        self.slot_mapping[:num_tokens].fill_(-1)
        self.input_ids[:num_tokens].zero_()
        self.positions[:num_tokens].zero_()
        self.seq_lens[:num_seqs].fill_(1)
        self.query_start_loc[: num_seqs + 1].copy_(torch.arange(num_seqs + 1, dtype=torch.int32))
        self.block_tables[:num_seqs].zero_()
        self.base_bounds[:num_seqs].zero_()  # structured path: no BASE range
        self.pair_mode[:num_seqs].zero_()  # general path: every pair TARGET


def block_table_array(rows: list[Seq[int]], num_rows: int, width: int) -> np.ndarray:
    """Ragged block tables as one zero-padded int32 [num_rows, width] array: one slice copy per row, a memory copy
    for the int32 rows the engine gathers (``BlockTable.row``; one small tensor per row had cost ~18 us each)."""
    table = np.zeros((num_rows, width), dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table


def _fill(buffer: torch.Tensor, values: list[int]) -> None:
    buffer[: len(values)].copy_(torch.tensor(values, dtype=buffer.dtype), non_blocking=True)
