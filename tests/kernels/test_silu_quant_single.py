"""The quantizing SiLU-and-mul's split route in one launch (``silu_mul.SINGLE_LAUNCH``; its programs wait for their
row's maximum). On the CPU: it compiles for sm90 with the PDL wait first, the publishing atomics and an acquiring spin
loop, and the interpreter (which runs programs one by one and could never finish it) never takes it. On a GPU, with
the table forced on: the very bytes of the two-launch route, call after call (the never-reset counters' generations,
row counts that change between calls), and in a CUDA graph replayed with new inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastiserve.kernels import silu_mul
from elastiserve.kernels.fp8_activations import quantize_per_token
from elastiserve.platforms import current_platform

COMPILE_REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "compile_report.py"
_COMPILE = """
import importlib.util, json, re, sys
spec = importlib.util.spec_from_file_location("compile_report", sys.argv[1])
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)
from elastiserve.kernels import silu_mul
fn = silu_mul._silu_mul_quant_waiting_kernel
types = {n: "i32" for n in fn.arg_names}
types.update({"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "gate_up_ptr": "*fp16", "sync_ptr": "*i64"})
const = {"FP8_MAX": 448.0, "MIN_NORMAL": 2.0 ** -6, "ROUND_IN_SOFTWARE": False, "BLOCK": 1024, "PDL": True}
body = report.compile_kernel(fn, types, const, 4, 1, 90).asm["ptx"]
body = body[body.index(".entry"):]
at = lambda pattern: [m.start() for m in re.finditer(pattern, body)]
print(json.dumps({"wait": at(r"griddepcontrol\\.wait"), "memory": at(r"\\b(ld|st)\\.global\\.(v|b)"),
                  "ticket": at(r"atom\\.global\\.gpu\\.relaxed\\.add"),
                  "max": at(r"atom\\.global\\.gpu\\.release\\.max\\.s64"),
                  "publish": at(r"atom\\.global\\.gpu\\.release\\.add"),
                  "spin": at(r"ld\\.global\\.gpu\\.acquire\\.b64"),
                  "loop": at(r"Loop Header"), "store": at(r"st\\.global")}))
"""


@pytest.mark.cpu
def test_it_compiles_for_sm90_with_the_wait_first_and_a_spin_loop():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(COMPILE_REPORT)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    at = json.loads(done.stdout.splitlines()[-1])
    assert len(at["wait"]) == 1 and at["wait"][0] < min(at["memory"]), at
    assert len(at["ticket"]) == len(at["max"]) == len(at["publish"]) == 1, at
    assert at["ticket"][0] < at["max"][0] < at["publish"][0] < min(at["spin"]), at  # publish, then wait
    assert len(at["spin"]) >= 3 and len(at["loop"]) == 1 and at["loop"][0] < max(at["spin"]), at  # and the max's
    assert max(at["spin"]) < min(at["store"]), at  # every code written after the row's max is known


@pytest.mark.cpu
def test_the_interpreter_never_takes_it(monkeypatch):
    monkeypatch.setitem(silu_mul.SINGLE_LAUNCH, current_platform().arch, True)
    assert not silu_mul.waits_fit(2, 14)  # interpreted: one program at a time would spin forever
    gate_up = (torch.randn(2, 2 * 5000, generator=torch.Generator().manual_seed(0)) * 3).half()
    q, scale = silu_mul.silu_and_mul_quant(gate_up, False)  # the two launches, as before
    ref_q, ref_scale = quantize_per_token(silu_mul.silu_and_mul(gate_up))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)


def same_rows(a, b) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def two_launches(gate_up):
    saved = dict(silu_mul.SINGLE_LAUNCH)
    silu_mul.SINGLE_LAUNCH.clear()
    try:
        return silu_mul.silu_and_mul_quant(gate_up, False)
    finally:
        silu_mul.SINGLE_LAUNCH.update(saved)


@pytest.fixture
def single_launch(monkeypatch):
    monkeypatch.setitem(silu_mul.SINGLE_LAUNCH, current_platform().arch, True)
    monkeypatch.setitem(silu_mul.SPLIT_QUANT_MAX_ROWS, current_platform().arch, 32)


def gate_ups(rows: int, inter: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, device="cuda", generator=gen) * 3).half()
    gate_up[0, 2 * inter - 1] = 60.0  # the first row's maximum in its last (maybe ragged) chunk
    return gate_up


@pytest.mark.cuda
@pytest.mark.parametrize("rows, inter", [(1, 14336), (2, 14336), (9, 14336), (3, 5000), (2, 4100)])
def test_bytes_equal_the_two_launches_call_after_call(single_launch, rows, inter):
    chunks = -(-inter // silu_mul.BLOCK)
    assert silu_mul.waits_fit(rows, chunks)
    for seed in range(4):  # each call a new generation of the same counters
        gate_up = gate_ups(rows, inter, seed)
        assert same_rows(silu_mul.silu_and_mul_quant(gate_up, False), two_launches(gate_up)), seed
    for count in (1, rows, 1, rows):  # rows that sit out a call keep their counters' generation in step
        gate_up = gate_ups(count, inter, 10 + count)
        assert same_rows(silu_mul.silu_and_mul_quant(gate_up, False), two_launches(gate_up)), count


@pytest.mark.cuda
def test_a_captured_launch_replays_with_new_inputs(single_launch):
    gate_up = gate_ups(2, 14336, 0)
    silu_mul.silu_and_mul_quant(gate_up, False)  # the counters exist before the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            q, scale = silu_mul.silu_and_mul_quant(gate_up, False)
    for seed in range(1, 6):
        gate_up.copy_(gate_ups(2, 14336, seed))
        graph.replay()
        torch.cuda.synchronize()
        assert same_rows((q, scale), two_launches(gate_up)), seed

