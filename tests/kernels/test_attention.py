"""Pins the elastic paged attention: per request, the reference op equals dense SDPA on the gathered K/V, where
K/V of BASE pairs are the E5M2 (rna high byte) values exactly; and the Triton kernel equals the reference on every
path (native, structured, general), for decode (with and without KV splits), extend and full prefill, GQA with an
odd group, odd head dims, odd tail blocks (a last pair of one block, a BASE pair whose B block is partly filled),
block sizes 16 and 32, and a structured BASE range whose edges fall inside a KV tile or a KV split. Also pins the
host planner's path choice and buffers, opcheck and torch.compile(fullgraph=True); split decode merges in the
attention launch (its counters left at zero, its sm90 PTX ordered as arrivals.py's proof needs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from attention_cases import LAYER, build_batch, dense_sdpa, metadata, run_attention

from elastiserve.kernels import arrivals
from elastiserve.kernels import attention as attention_mod
from elastiserve.kernels.attention import paged_attention, split_counters
from elastiserve.kernels.attention_plan import (
    GENERAL,
    NATIVE,
    STRUCTURED,
    STRUCTURED_SPLIT,
    AttentionPlanBuffers,
    AttentionPlanConfig,
    plan_attention,
)

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

SCENARIOS = {
    # ragged, decode + extend, BASE ranges starting inside the first TARGET tile, odd tails (70 = 4 blocks + 6)
    "structured": dict(seq_lens=[70, 5, 130, 33], q_lens=[1, 5, 3, 1], base_pairs=[[1], [], [0, 1, 2], [0]]),
    "general": dict(seq_lens=[70, 130, 20], q_lens=[2, 1, 1], base_pairs=[[0], [0, 2, 3], []]),
    # every complete pair BASE; 60 tokens = 4 blocks, the last only 12 full: a BASE pair with a partial B block
    "all_base": dict(seq_lens=[60, 97], q_lens=[1, 4], base_pairs=[[0, 1], [0, 1, 2]]),
    "all_target": dict(seq_lens=[45, 3], q_lens=[1, 3], base_pairs=[[], []]),
    # full prefill, several query tiles, block size 32, a group of 4
    "prefill": dict(seq_lens=[45, 100], q_lens=[45, 100], base_pairs=[[], [0]], group=4, block_size=32, head_dim=16),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reference_equals_dense_sdpa_on_gathered_kv(device, name):
    batch = build_batch(device, **SCENARIOS[name])
    path, bounds, modes = metadata(batch, device)
    got = run_attention(batch, path, bounds, modes, ref=True)
    torch.testing.assert_close(got.float(), dense_sdpa(batch, 0.37), atol=2e-3, rtol=2e-3)


KERNEL_CASES = [
    ("structured", STRUCTURED),
    ("structured", GENERAL),
    ("general", GENERAL),
    ("all_base", STRUCTURED),
    ("all_base", GENERAL),
    ("all_target", NATIVE),
    ("all_target", STRUCTURED),
    ("prefill", STRUCTURED),
]


@pytest.mark.parametrize("name, path", KERNEL_CASES)
def test_kernel_equals_reference(device, name, path):
    batch = build_batch(device, **SCENARIOS[name])
    planned, bounds, modes = metadata(batch, device, path)
    assert planned == path
    expected = run_attention(batch, path, bounds, modes, ref=True)
    got = run_attention(batch, path, bounds, modes)
    torch.testing.assert_close(got, expected, atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("path", [STRUCTURED, GENERAL, STRUCTURED_SPLIT])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kv_splits_equal_reference(device, path, num_splits):
    # 300 tokens = 19 blocks = 10 pairs; 3 splits of 4 pairs put split edges inside the BASE run 3..6.
    batch = build_batch(device, [300, 17, 250], [1, 1, 1], [[3, 4, 5, 6], [], [2]], group=4, head_dim=32)
    _, bounds, modes = metadata(batch, device, path)
    expected = run_attention(batch, path, bounds, modes, ref=True)
    got = run_attention(batch, path, bounds, modes, num_splits=num_splits)
    torch.testing.assert_close(got, expected, atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("factor, num_splits", [(2, 1), (3, 3), (4, 16)])
def test_base_launch_with_its_own_split_count_equals_reference(device, factor, num_splits, monkeypatch):
    # Path 3's BASE launch at `factor` times the first launch's splits (attention.BASE_LAUNCH_SPLIT_FACTOR): its
    # slots start after the first launch's, the merge reads the filled ones of both (16 x 4 splits over 10 pairs:
    # most ranges empty). Split edges inside the BASE run 3..6; a sequence without BASE; a one-pair BASE run.
    monkeypatch.setattr(attention_mod, "BASE_LAUNCH_SPLIT_FACTOR", factor)
    batch = build_batch(device, [300, 17, 250, 64], [1, 1, 1, 1], [[3, 4, 5, 6], [], [2], [0, 1]], group=4,
                        head_dim=32)
    _, bounds, modes = metadata(batch, device, STRUCTURED_SPLIT)
    expected = run_attention(batch, STRUCTURED_SPLIT, bounds, modes, ref=True)
    got = run_attention(batch, STRUCTURED_SPLIT, bounds, modes, num_splits=num_splits)
    torch.testing.assert_close(got, expected, atol=4e-3, rtol=1e-2)


def test_ptx_unpack_only_where_the_gpu_runs_ptx(device, monkeypatch):
    # attention.UNPACK_BASE_PTX asks for inline PTX; the interpreter (and AMD) keep Triton's 16-bit ops, so the switch
    # on changes nothing there and the CPU results stay the reference's.
    monkeypatch.setattr(attention_mod, "UNPACK_BASE_PTX", True)
    assert attention_mod.unpack_base_ptx() is (device.type == "cuda")
    batch = build_batch(device, [70, 130], [1, 1], [[0, 1], [1, 2, 3]], group=4, head_dim=32)
    for path in (STRUCTURED, GENERAL, STRUCTURED_SPLIT):
        _, bounds, modes = metadata(batch, device, path)
        expected = run_attention(batch, path, bounds, modes, ref=True)
        torch.testing.assert_close(run_attention(batch, path, bounds, modes), expected, atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("slices, num_splits, head_dim", [(4, 1, 32), (2, 3, 32), (4, 4, 24)])
def test_sliced_base_launch_equals_reference(device, slices, num_splits, head_dim, monkeypatch):
    # Path 3's BASE launch with a warp a slice (attention.BASE_LAUNCH_SLICES): slices past the run's end empty, a
    # one-pair run, a BASE pair with a partly filled B block (250 tokens), an odd head dim, and block size 8 (too
    # small for the sliced dots), which keeps the shared loop.
    monkeypatch.setattr(attention_mod, "BASE_LAUNCH_SLICES", slices)
    for block_size, seq_lens in ((16, [300, 17, 250, 64]), (8, [150, 9, 125, 32])):
        batch = build_batch(device, seq_lens, [1, 1, 1, 1], [[3, 4, 5, 6, 7], [], [2], [0, 1]], group=4,
                            head_dim=head_dim, block_size=block_size)
        _, bounds, modes = metadata(batch, device, STRUCTURED_SPLIT)
        expected = run_attention(batch, STRUCTURED_SPLIT, bounds, modes, ref=True)
        got = run_attention(batch, STRUCTURED_SPLIT, bounds, modes, num_splits=num_splits)
        torch.testing.assert_close(got, expected, atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("path", [NATIVE, STRUCTURED, GENERAL, STRUCTURED_SPLIT])
def test_more_splits_than_pairs_merge_only_the_filled_ones(device, path):
    # 16 splits over 1-10 pairs: trailing ranges are empty and the merge (the last program of each sequence and kv
    # head, in the attention launch) reads only the filled ones (native: ranges of 2 pairs, so 300 tokens fill 5;
    # the BASE-capable paths align to 4). A 1-token sequence fills one. Path 3 merges both launches' partials.
    pair_base = [[], [], [], []] if path == NATIVE else [[3, 4, 5, 6], [], [2], []]
    batch = build_batch(device, [300, 17, 250, 1], [1, 1, 1, 1], pair_base, group=4, head_dim=32)
    _, bounds, modes = metadata(batch, device, path)
    expected = run_attention(batch, path, bounds, modes, ref=True)
    got = run_attention(batch, path, bounds, modes, num_splits=16)
    torch.testing.assert_close(got, expected, atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("path", [NATIVE, STRUCTURED_SPLIT])
def test_short_queries_run_unsplit_in_one_variant_per_tile(device, path, monkeypatch):
    """Queries of 2-4 tokens in one tile beside decodes (a prefill's last tokens) run without KV splits and keep the
    whole tile for path 3 + 4's merge, whatever split count is asked: split counts and merge rows are constexprs,
    and choosing them from the batch and the query length compiled mid-run (session 25 on the H200)."""
    from elastiserve.kernels import attention

    launches, real = [], attention.paged_attention_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs)
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attention, "paged_attention_kernel", Recorder())
    pair_base = [[], [], []] if path == NATIVE else [[3, 4, 5, 6], [], [2]]
    batch = build_batch(device, [300, 17, 250], [3, 1, 4], pair_base, group=4, head_dim=32)
    _, bounds, modes = metadata(batch, device, path)
    expected = run_attention(batch, path, bounds, modes, ref=True)
    torch.testing.assert_close(run_attention(batch, path, bounds, modes, num_splits=16), expected,
                               atol=4e-3, rtol=1e-2)
    assert launches and {launch["NUM_SPLITS"] for launch in launches} == {1}
    assert all(launch["MERGE_ROWS"] == launch["BLOCK_M"] == 16 for launch in launches)  # 4 queries x group 4
    assert not split_counters(batch.q.device, 0).any()


@pytest.mark.parametrize("path", [NATIVE, STRUCTURED_SPLIT])
def test_merge_leaves_its_counters_at_zero_for_the_next_call(device, path):
    """The merging program resets its (sequence, kv head) arrival counter: after a split decode call every counter
    is zero, and a second call (the next layer) and a larger batch (other counters) still merge right."""
    pair_base = [[], [], [], []] if path == NATIVE else [[3, 4, 5, 6], [], [2], []]
    batch = build_batch(device, [300, 17, 250, 1], [1, 1, 1, 1], pair_base, group=4, head_dim=32)
    _, bounds, modes = metadata(batch, device, path)
    expected = run_attention(batch, path, bounds, modes, ref=True)
    for _layer in range(2):
        torch.testing.assert_close(run_attention(batch, path, bounds, modes, num_splits=16), expected,
                                   atol=4e-3, rtol=1e-2)
        assert not split_counters(batch.q.device, 0).any()
    wider = build_batch(device, [40, 300, 17, 250, 1, 90], [1] * 6, [[], *pair_base, [] if path == NATIVE else [1]],
                        group=4, head_dim=32, seed=3)
    _, bounds, modes = metadata(wider, device, path)
    torch.testing.assert_close(run_attention(wider, path, bounds, modes, num_splits=5),
                               run_attention(wider, path, bounds, modes, ref=True), atol=4e-3, rtol=1e-2)
    assert not split_counters(batch.q.device, 0).any()


def test_split_counters_grow_without_freeing_the_outgrown_buffer(device):
    """A captured graph keeps the address of the buffer it launched with: growing returns a new zeroed buffer and
    keeps the old one alive."""
    small = split_counters(device, 4)
    assert split_counters(device, small.numel()) is small
    grown = split_counters(device, small.numel() + 1)
    assert grown.numel() > small.numel() and not grown.any()
    assert any(kept is small for kept in arrivals._outgrown)
    assert split_counters(device, 1) is grown


@pytest.mark.parametrize("name", ["structured", "all_base", "all_target", "prefill"])
def test_split_launch_structured_path_equals_one_launch(device, name):
    """Path 3 reads path 1's layout in two launches (TARGET ranges, BASE run) merged as KV splits; prefill tiles
    fall back to path 1. Both must give the reference's result."""
    batch = build_batch(device, **SCENARIOS[name])
    _, bounds, modes = metadata(batch, device, STRUCTURED)
    expected = run_attention(batch, STRUCTURED, bounds, modes, ref=True)
    torch.testing.assert_close(run_attention(batch, STRUCTURED_SPLIT, bounds, modes), expected, atol=4e-3, rtol=1e-2)
    torch.testing.assert_close(run_attention(batch, STRUCTURED_SPLIT, bounds, modes, ref=True), expected)


def test_plan_chooses_path_and_fills_buffers(device):
    buffers = AttentionPlanBuffers(AttentionPlanConfig(max_batch=4, max_pairs=5), device)
    assert plan_attention([[0, 0], [0]], buffers).path == NATIVE
    plan = plan_attention([[0, 1, 1, 0], [], [1, 0]], buffers)
    assert plan.path == STRUCTURED_SPLIT  # T*B*T* is read by path 3 (attention_plan.STRUCTURED_READ_PATH)
    assert plan.base_bounds[:3].cpu().tolist() == [[1, 3], [0, 0], [0, 1]]
    plan = plan_attention([np.array([1, 0, 1], dtype=np.uint8), [0, 1]], buffers)
    assert plan.path == GENERAL
    assert plan.pair_mode[:2].cpu().tolist() == [[1, 0, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert plan.pair_mode.data_ptr() == buffers.pair_mode.data_ptr(), "buffers must stay put for CUDA graphs"


def test_opcheck(device):
    batch = build_batch(device, **SCENARIOS["all_base"])
    _, bounds, modes = metadata(batch, device, GENERAL)
    args = (batch.q, batch.cache, LAYER, batch.block_tables, batch.seq_lens, batch.query_start_loc, bounds, modes)
    kwargs = dict(scale=0.5, max_query_len=batch.max_query_len, path=GENERAL)
    torch.library.opcheck(torch.ops.elastiserve.paged_attention.default, args, kwargs)


def test_compile_fullgraph(device):
    batch = build_batch(device, **SCENARIOS["structured"])
    _path, bounds, _modes = metadata(batch, device)

    def layer_step(q, cache, block_tables, seq_lens, qsl, bounds):
        out = paged_attention(
            q * 1.0, cache, LAYER, block_tables, seq_lens, qsl, base_bounds=bounds, scale=0.37, max_query_len=5,
            path=STRUCTURED,
        )  # fmt: skip
        return out.float() * 2.0

    args = (batch.q, batch.cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, bounds)
    expected = layer_step(*args)
    compiled = torch.compile(layer_step, fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    torch.testing.assert_close(compiled(*args), expected, atol=0, rtol=0)


@pytest.mark.parametrize("name, path", [("structured", STRUCTURED), ("general", GENERAL), ("prefill", NATIVE)])
def test_padding_of_a_mixed_graph_leaves_real_rows_unchanged(device, name, path):
    """A mixed step replayed from a graph (engine graphs.py) is padded: sequences with no queries and no KV, query
    rows past ``query_start_loc[B]`` that belong to no sequence, and ``max_query_len`` set to the padded token count
    (a larger grid, and a taller query tile, so the GPU may sum in another order: the kernel tolerance, not
    equality; the interpreter gives equal rows)."""
    batch = build_batch(device, **SCENARIOS[name])
    _, bounds, modes = metadata(batch, device, path)
    expected = run_attention(batch, path, bounds, modes)
    real_seqs, real_tokens = batch.seq_lens.shape[0], batch.q.shape[0]
    pad_seqs, padded_tokens = 3, real_tokens + 37
    gen = torch.Generator().manual_seed(5)
    q = torch.cat([batch.q, torch.randn(padded_tokens - real_tokens, *batch.q.shape[1:], generator=gen).half()
                   .to(device)])
    zeros = torch.zeros(pad_seqs, dtype=torch.int32, device=device)
    tables = torch.cat([batch.block_tables, torch.zeros(pad_seqs, batch.block_tables.shape[1], dtype=torch.int32,
                                                        device=device)])
    qsl = torch.cat([batch.query_start_loc, batch.query_start_loc[-1:].repeat(pad_seqs)])
    extra = {"base_bounds": torch.cat([bounds[:real_seqs], torch.zeros(pad_seqs, 2, dtype=torch.int32,
                                                                       device=device)]).contiguous()} \
        if path == STRUCTURED else {"pair_mode": torch.cat([modes[:real_seqs], torch.zeros(
            pad_seqs, modes.shape[1], dtype=torch.uint8, device=device)])} if path == GENERAL else {}
    got = paged_attention(q, batch.cache, LAYER, tables, torch.cat([batch.seq_lens, zeros]), qsl,
                          scale=0.37, max_query_len=padded_tokens, path=path, **extra)
    torch.testing.assert_close(got[:real_tokens], expected, atol=4e-3, rtol=1e-2)


COMPILE_REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "compile_report.py"
_MERGE_PTX = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("compile_report", sys.argv[1])
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)
print(json.dumps(report.merge_problems(report.compile_attention(0, 4, 16, True, 90).asm["ptx"])))
"""


def test_merge_ptx_orders_partials_barrier_atomic_barrier_merge():
    """Compiled for sm90 (on the CPU): one acq_rel atomic at gpu scope, a CTA barrier between the partial stores and
    it, and one between it and the merge's loads (the result reaches every thread through shared memory)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _MERGE_PTX, str(COMPILE_REPORT)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


_BASE_LOOPS = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("compile_report", sys.argv[1])
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)
kernels = [report.compile_attention(4, 2, 16, True, 90, True, slices, True) for slices in (0, 4)]
print(json.dumps([report.sass_loops(kernel) for kernel in kernels]))
"""


def test_sliced_base_loop_has_fewer_barriers_and_instructions_a_token():
    """Path 3's BASE launch compiled for sm90 (on the CPU) with the PTX unpack: the shared loop (2 pairs = 64 tokens
    an iteration, 4 warps) unpacks with one LOP3 and one PRMT per two words and no shifts; the sliced loop (a pair a
    warp, 128 tokens) has only the pipeline's barriers and at most 0.8x the warp-instructions a token (session 33:
    439 x 4 / 64 = 27.4 against 628 x 4 / 128 = 19.6)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _BASE_LOOPS, str(COMPILE_REPORT)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (shared,), (sliced,) = json.loads(done.stdout.splitlines()[-1])
    assert shared["HMMA.16816"] == 32 and shared.get("IMAD.SHL", 0) == 0 and shared["PRMT"] == 32
    # the pipeline's own 2 barriers an iteration stay; the shared loop's cross-warp reductions took 14 more
    assert sliced["HMMA.16816"] == 64 and sliced["BAR.SYNC"] <= 2 and shared["BAR.SYNC"] >= 16
    assert sum(sliced.values()) * 4 / 128 <= 0.8 * sum(shared.values()) * 4 / 64
