"""CUDA-only pins of the paged attention: decode captured in a CUDA graph replays correctly after q and the
metadata change in place (fixed grid, no host syncs inside), and real decode sizes (32 q / 8 kv heads, dim 128, up
to 4096 tokens) match the reference on every path and split count."""

from __future__ import annotations

import pytest
import torch
from attention_cases import LAYER, build_batch, metadata, run_attention

from elastiserve.kernels.attention import paged_attention
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
