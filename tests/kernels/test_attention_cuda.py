"""CUDA-only pins of the paged attention: decode captured in a CUDA graph replays correctly after q and the
metadata change in place (fixed grid, no host syncs inside), and real decode sizes (32 q / 8 kv heads, dim 128, up
to 4096 tokens) match the reference on every path and split count. Split decode merges in the attention launch with
per-(sequence, kv head) arrival counters that every call must leave at zero: 16 forced splits over 1-10 filled pairs,
two calls in a row, and a graph of two calls replayed twice with other seq_lens (a counter left non-zero fails the
next call), also when the counters are first allocated inside the capture."""

from __future__ import annotations

import pytest
import torch
from attention_cases import LAYER, build_batch, metadata, run_attention

from elastiserve.kernels import arrivals
from elastiserve.kernels import attention as attention_mod
from elastiserve.kernels.attention import paged_attention, split_counters
from elastiserve.kernels.attention_plan import GENERAL, NATIVE, STRUCTURED, STRUCTURED_SPLIT

pytestmark = [pytest.mark.cuda]


@pytest.mark.parametrize("path", [NATIVE, STRUCTURED, GENERAL, STRUCTURED_SPLIT])
def test_cuda_graph_decode_replays_with_new_metadata(path):
    device = torch.device("cuda")
    base = [[], [1, 2], [0]] if path != NATIVE else [[], [], []]
    batch = build_batch(device, [40, 300, 150], [1, 1, 1], base, group=4, head_dim=128, kv_heads=2)
    _, bounds, modes = metadata(batch, device, path)
    static_q = batch.q.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_attention(batch, path, bounds, modes)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = paged_attention(
            static_q, batch.cache, LAYER, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            base_bounds=bounds, pair_mode=modes, scale=0.37, max_query_len=1, path=path,
        )  # fmt: skip
    static_q.copy_(torch.randn_like(static_q))
    batch.seq_lens[0] = 33  # metadata changes in place between replays
    graph.replay()
    torch.cuda.synchronize()
    batch.q = static_q
    expected = run_attention(batch, path, bounds, modes, ref=True)
    torch.testing.assert_close(static_out, expected, atol=4e-3, rtol=1e-2)


REAL_SIZE_BASE = {
    NATIVE: [[], [], [], []],
    STRUCTURED: [list(range(10, 40)), list(range(0, 31)), [5, 6, 7], []],
    STRUCTURED_SPLIT: [list(range(10, 40)), list(range(0, 31)), [5, 6, 7], []],
    GENERAL: [list(range(10, 40)), [0, 3, 4, 30], [5, 7, 9], []],
}


@pytest.mark.parametrize("factor, registers, slices",
                         [(2, None, 0), (2, 96, 0), (4, 80, 0), (1, None, 4), (1, 168, 4), (2, None, 2)])
def test_real_size_base_launch_settings_equal_reference(factor, registers, slices, monkeypatch):
    # The base-launch and sliced sweeps' settings (bench_attention.SWEEPS): more KV splits for path 3's BASE launch, a
    # register cap (PTX .maxnreg; 80 spills a few bytes), a warp a slice - the same result as the reference at real
    # sizes.
    monkeypatch.setattr(attention_mod, "BASE_LAUNCH_SPLIT_FACTOR", factor)
    monkeypatch.setattr(attention_mod, "BASE_LAUNCH_MAX_REGISTERS", registers)
    monkeypatch.setattr(attention_mod, "BASE_LAUNCH_SLICES", slices)
    monkeypatch.setattr(attention_mod, "UNPACK_BASE_PTX", slices > 0)  # as the sliced sweep runs it
    device = torch.device("cuda")
    batch = build_batch(device, [4096, 1000, 2049, 17] * 4, [1] * 16, REAL_SIZE_BASE[STRUCTURED_SPLIT] * 4,
                        kv_heads=8, group=4, head_dim=128)
    _, bounds, modes = metadata(batch, device, STRUCTURED_SPLIT)
    expected = run_attention(batch, STRUCTURED_SPLIT, bounds, modes, ref=True)
    for num_splits in (0, 1, 4):
        got = run_attention(batch, STRUCTURED_SPLIT, bounds, modes, num_splits=num_splits)
        torch.testing.assert_close(got, expected, atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("path", [STRUCTURED, GENERAL, STRUCTURED_SPLIT])
@pytest.mark.parametrize("query_len", [1, 7])
def test_ptx_base_unpack_gives_the_bits_of_triton_ops(path, query_len, monkeypatch):
    # BASE words unpacked two at a time by inline PTX (attention.UNPACK_BASE_PTX) against Triton's 16-bit ops: the
    # same fp16 values enter the same dots, so the outputs are equal bit for bit, decode and extend.
    device = torch.device("cuda")
    seq_lens = [4096, 1000, 2049, 17] * 2
    batch = build_batch(device, seq_lens, [query_len] * 8, REAL_SIZE_BASE[path] * 2, kv_heads=8, group=4,
                        head_dim=128)
    _, bounds, modes = metadata(batch, device, path)
    outputs = []
    for ptx in (False, True):
        monkeypatch.setattr(attention_mod, "UNPACK_BASE_PTX", ptx)
        assert attention_mod.unpack_base_ptx() is ptx
        outputs.append(run_attention(batch, path, bounds, modes))
    assert torch.equal(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[1], run_attention(batch, path, bounds, modes, ref=True), atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("path", [NATIVE, STRUCTURED, GENERAL, STRUCTURED_SPLIT])
def test_real_size_decode_equals_reference(path):
    device = torch.device("cuda")
    seq_lens = [4096, 1000, 2049, 17] * 4
    batch = build_batch(device, seq_lens, [1] * 16, REAL_SIZE_BASE[path] * 4, kv_heads=8, group=4, head_dim=128)
    _, bounds, modes = metadata(batch, device, path)
    expected = run_attention(batch, path, bounds, modes, ref=True)
    for num_splits in (0, 1, 4):
        got = run_attention(batch, path, bounds, modes, num_splits=num_splits)
        torch.testing.assert_close(got, expected, atol=4e-3, rtol=1e-2)


def test_real_size_prefill_equals_reference():
    device = torch.device("cuda")
    batch = build_batch(
        device, [1500, 700, 64], [1500, 300, 1], [list(range(3, 20)), [], []], kv_heads=8, group=4, head_dim=128
    )
    _, bounds, modes = metadata(batch, device, STRUCTURED)
    expected = run_attention(batch, STRUCTURED, bounds, modes, ref=True)
    got = run_attention(batch, STRUCTURED, bounds, modes)
    torch.testing.assert_close(got, expected, atol=4e-3, rtol=1e-2)


# 1..10 filled pairs (block size 16: a pair is 32 tokens) under 16 forced splits; BASE pairs inside every sequence
# long enough to hold one, contiguous for the structured paths.
FILLED_SEQ_LENS = [1, 32, 33, 64, 100, 130, 200, 250, 290, 320]
FILLED_BASE = {
    NATIVE: [[]] * 10,
    STRUCTURED: [[], [], [], [0], [1, 2], [0, 1], [3, 4, 5], [2], list(range(9)), [4, 5]],
    STRUCTURED_SPLIT: [[], [], [], [0], [1, 2], [0, 1], [3, 4, 5], [2], list(range(9)), [4, 5]],
    GENERAL: [[], [], [], [1], [0, 2], [1, 3], [0, 3, 5], [1, 6], [0, 2, 4, 8], [9]],
}


@pytest.mark.parametrize("path", [NATIVE, STRUCTURED, GENERAL, STRUCTURED_SPLIT])
def test_sixteen_splits_over_few_pairs_merge_in_the_launch(path):
    device = torch.device("cuda")
    batch = build_batch(device, FILLED_SEQ_LENS, [1] * 10, FILLED_BASE[path], kv_heads=8, group=4, head_dim=128)
    _, bounds, modes = metadata(batch, device, path)
    expected = run_attention(batch, path, bounds, modes, ref=True)
    for _layer in range(2):  # the second call finds the counters the first one left
        torch.testing.assert_close(run_attention(batch, path, bounds, modes, num_splits=16), expected,
                                   atol=4e-3, rtol=1e-2)
    torch.cuda.synchronize()
    assert not split_counters(device, 0).any()


@pytest.mark.parametrize("grow_in_capture", [False, True])
@pytest.mark.parametrize("path", [NATIVE, STRUCTURED, GENERAL, STRUCTURED_SPLIT])
def test_cuda_graph_of_two_split_calls_replays_twice(path, grow_in_capture, monkeypatch):
    """Two split decode calls (two layers) in one graph, replayed with other seq_lens each time. With
    ``grow_in_capture`` the counter cache is empty at capture, so the calls take counters zeroed inside the graph."""
    device = torch.device("cuda")
    batch = build_batch(device, FILLED_SEQ_LENS, [1] * 10, FILLED_BASE[path], kv_heads=8, group=4, head_dim=128)
    _, bounds, modes = metadata(batch, device, path)
    queries = [batch.q.clone(), torch.randn_like(batch.q)]

    def two_layers():
        return [paged_attention(q, batch.cache, LAYER, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                base_bounds=bounds, pair_mode=modes, scale=0.37, max_query_len=1, path=path,
                                num_splits=16) for q in queries]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        two_layers()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    if grow_in_capture:
        monkeypatch.setattr(arrivals, "_counters", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = two_layers()
    if grow_in_capture:
        assert not arrivals._counters, "counters zeroed inside a capture must not be cached"
    # Shorter contexts than built (the blocks stay allocated), every BASE pair keeping both its blocks.
    for seq_lens in ([1, 20, 33, 64, 99, 130, 190, 250, 280, 320], [1, 32, 30, 50, 100, 129, 200, 240, 290, 310]):
        batch.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for q, out in zip(queries, outs):
            batch.q = q
            torch.testing.assert_close(out, run_attention(batch, path, bounds, modes, ref=True), atol=4e-3,
                                       rtol=1e-2)
