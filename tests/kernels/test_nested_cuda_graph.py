"""Pins that the nested ops are CUDA-graph capturable: a NestedLinear model and the grouped MoE op are captured in
both modes (fast at a decode and a prefill batch, so both the weight-only and the fp8 path), replayed on new
inputs, and match eager execution; so is a fast head that keeps its top logits exact. CUDA only: capture needs a
GPU.
"""

import pytest
import torch
from torch import nn

from elastiserve.kernels import formats, nested_moe
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.nested_linear import nest_model, set_mode

pytestmark = [pytest.mark.cuda]


def _capture(fn, static_input):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(static_input)  # warm up (compiles the kernels outside the capture)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = fn(static_input)
    return graph, static_output


def _replays_match(model, static_x):
    """Capture ``model`` on ``static_x``, then replay on new inputs twice: each replay matches eager execution."""
    graph, static_y = _capture(model, static_x)
    for _ in range(2):
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(static_y, model(static_x), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode", ["full", "fast"])
@pytest.mark.parametrize("batch", [3, 300])
def test_nested_model_graph_replay(device, mode, batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 256)).to(device).half()
    with torch.no_grad():
        model[2].weight.mul_(1000.0)  # max|w| ~ 31 > 16 * 1.8192 (beyond the E4M3 prescale): the second layer is E5M2
    report = nest_model(model)
    assert [kind for kind, _ in report.layers.values()] == [Nesting.E4M3, Nesting.E5M2]
    set_mode(model, mode)
    static_x = torch.randn(batch, 512, device=device, dtype=torch.float16)
    _replays_match(model, static_x)


@pytest.mark.parametrize("batch", [1, 40])
def test_exact_top_head_graph_replay(device, batch):
    """A fast head that keeps its 8 largest logits a row exact (top-k, elastiserve::exact_rows, scatter) replays."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(512, 4000, bias=False)).to(device).half()
    nest_model(head, skip=())
    set_mode(head, "fast")
    head[0].set_exact_top(8)
    static_x = torch.randn(batch, 512, device=device, dtype=torch.float16)
    _replays_match(head, static_x)


@pytest.mark.parametrize("fast", [False, True])
def test_nested_moe_graph_replay(device, fast):
    torch.manual_seed(0)
    experts, n, k, rows = 8, 256, 512, 200
    upper, lower = formats.split((torch.randn(experts, n, k, device=device) * 0.02).half(), Nesting.E4M3)
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device=device)
    static_x = torch.randn(rows, k, device=device, dtype=torch.float16)

    def run(x):
        return torch.ops.elastiserve.nested_moe(x, upper, lower, offsets, int(Nesting.E4M3), fast)

    offsets[1:] = torch.tensor([0, 30, 30, 60, 100, 140, 190, 200], device=device)
    graph, static_y = _capture(run, static_x)
    # new routing between replays: the tile map is rebuilt on the device inside the graph
    offsets[1:] = torch.tensor([50, 50, 51, 90, 120, 121, 180, 200], device=device)
    graph.replay()
    torch.cuda.synchronize()
    mode = "full" if not fast else nested_moe.fast_mode_for(rows, grouped=True)
    want = nested_moe.nested_moe_ref(static_x, upper, lower, offsets, 1, mode)
    assert torch.allclose(static_y, want, rtol=1e-2, atol=1e-2)
