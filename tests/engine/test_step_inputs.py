"""Pins the step's BASE bounds: ``KVManager.base_bounds`` is kept incrementally through demote / begin_promote /
finish_promote / free / preemption, so a step builds no per-pair list for a sequence whose BASE pairs (BASE or
PROMOTING) are one run. Under any order of those calls it must agree with the bounds read from ``pair_modes``, and
the loaded step (path, ``base_bounds``, ``pair_mode``) must be what ``choose_path`` over every ``pair_modes`` list
gave before, scattered layouts and graph padding included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.kv_manager import FlatBlockPool, KVManager
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import ScheduledBatch
from elastiserve.engine.sequence import Sequence, SequenceMetrics
from elastiserve.engine.step_inputs import InputBuffers, gather_step_inputs
from elastiserve.kernels.attention_plan import GENERAL, STRUCTURED, STRUCTURED_SPLIT, choose_path

pytestmark = [pytest.mark.cpu]

BS = 4
MAX_PAIRS = 8  # short sequences and few of them: small scattered sets, whose edge promotions are the hard case
ACTIONS = ["demote", "demote_oldest", "promote", "promote_front", "finish", "free", "preempt"]


def bounds_from_modes(modes: list[int]) -> tuple[int, int] | None:
    base = [p for p, mode in enumerate(modes) if mode]
    if not base:
        return 0, 0
    return (base[0], base[-1] + 1) if len(base) == base[-1] + 1 - base[0] else None


def decoding(kv: KVManager, seq: Sequence) -> Sequence:
    assert kv.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens - 1  # one token left: a decode step
    return seq


def new_seq(kv: KVManager, request_id: str, num_tokens: int) -> Sequence:
    seq = Sequence(request_id, list(range(num_tokens)), num_tokens, SamplingParams(), SequenceMetrics(0.0))
    return decoding(kv, seq)


def old_load(live: list[Sequence], padded: int) -> tuple[int, list | None, torch.Tensor | None]:
    """What the step loaded before the bounds were tracked: ``choose_path`` over every ``pair_modes`` list."""
    modes = [KVManager.pair_modes(seq) for seq in live]
    path, bounds = choose_path(modes)
    if path in (STRUCTURED, STRUCTURED_SPLIT):
        return path, [list(b) for b in bounds] + [[0, 0]] * (padded - len(live)), None
    if path == GENERAL:
        table = torch.zeros((padded, MAX_PAIRS), dtype=torch.uint8)
        for i, row in enumerate(modes):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.uint8)
        return path, None, table
    return path, None, None


def check_step(kv: KVManager, buffers: InputBuffers, live: list[Sequence], pad: int) -> None:
    for seq in live:
        assert kv.base_bounds(seq) == bounds_from_modes(KVManager.pair_modes(seq))
    inputs = gather_step_inputs(ScheduledBatch(list(live), [1] * len(live)), kv)
    assert inputs.pair_modes == {i: KVManager.pair_modes(s) for i, s in enumerate(live) if kv.base_bounds(s) is None}
    padded = len(live) + pad
    meta = buffers.load(inputs, padded_batch=padded)
    path, bounds, table = old_load(live, padded)
    assert meta.path == path
    assert (meta.base_bounds.tolist() if meta.base_bounds is not None else None) == bounds
    assert (meta.pair_mode is None) == (table is None)
    if table is not None:
        assert torch.equal(meta.pair_mode, table)


OPS = st.tuples(st.sampled_from(ACTIONS), st.integers(0, 1 << 16), st.integers(0, 2))  # action, which one, padding


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(3 * 2 * BS, MAX_PAIRS * 2 * BS), min_size=1, max_size=4),
       st.lists(OPS, min_size=20, max_size=60))  # long runs: short ones rarely reach scattered sets or promotions
def test_incremental_bounds_and_step_inputs_match_pair_modes(lengths, ops):
    kv = KVManager(FlatBlockPool(400), BS, num_host_slots=40, sink_pairs=1, recent_pairs=1)
    config = EngineConfig(model="unused", device="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    buffers = InputBuffers(config, 2 * MAX_PAIRS, torch.device("cpu"))
    live = [new_seq(kv, f"r{i}", n) for i, n in enumerate(lengths)]
    for step, (action, pick, pad) in enumerate(ops):
        base = list(kv.promotion_candidates(live))
        in_flight = kv.promotions_in_flight()
        if action.startswith("demote") and kv.num_free_slots:
            cands = [(s, p) for s in live for p in kv.demotable_pairs(s)[:1 if action == "demote_oldest" else None]]
            if cands:
                kv.release_demoted([kv.demote(*cands[pick % len(cands)])])
        elif action == "promote" and base:
            kv.begin_promote(*base[pick % len(base)])
        elif action == "promote_front" and base:  # the engine's order: earliest request, front pair first
            kv.begin_promote(*base[0])
        elif action == "finish" and in_flight:
            op = in_flight[pick % len(in_flight)]
            kv.finish_promote(next(s for s in live if s.request_id == op.request_id), op)
        elif action == "free":  # a request finishes and a new one of the same length takes its place
            seq = live.pop(pick % len(live))
            kv.free_sequence(seq)
            live.append(new_seq(kv, f"n{step}", seq.num_tokens))
        elif action == "preempt":  # the scheduler's recompute: same request, fresh blocks, every pair TARGET
            seq = live[pick % len(live)]
            kv.free_sequence(seq)
            seq.reset_for_recompute()
            decoding(kv, seq)
        check_step(kv, buffers, live, pad)
