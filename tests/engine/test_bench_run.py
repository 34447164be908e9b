"""Benchmark harness: the metrics glue against hand-computed records and events, exact-length random prompts,
open- and closed-loop replay timing on the fake engine, and a short in-process bench run (two policies, a two-rate
sweep) that writes its JSON (commit, device, settings) and both PNG plots; plus one run on the real engine.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
from fake_engine import EOS, FakeEngine

from elastiserve.control.metrics import RequestRecord
from elastiserve.control.workloads import Request
from elastiserve.engine.bench.replay import ReplayResult, replay_in_process
from elastiserve.engine.bench.results import capacity, fp8_layer_time, per_request, summarize
from elastiserve.engine.bench.run import BenchPlan, run_bench
from elastiserve.engine.bench.workload import WorkloadSpec, build_requests, make_prompts
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]


def record(req_id, arrival, times, finish=True, preemptions=0, base=0, pairs=0):
    r = RequestRecord(
        req_id, arrival, 8, len(times), list(times), times[-1] if finish and times else None, preemptions, base, pairs
    )
    return r


def test_summary_glue_matches_hand_computation():
    # T_base 0.1 s: the SLO allows max TBT <= 0.5 s and TTFT <= 2 s.
    records = [
        record(0, 0.0, [1.0, 1.1, 1.2, 1.3]),  # TTFT 1.0, gaps .1: meets
        record(1, 0.5, [3.0, 3.1]),  # TTFT 2.5: misses
        record(2, 1.0, [1.5, 2.2, 2.3], preemptions=1, base=30, pairs=100),  # gap 0.7 > 0.5: misses
        record(3, 2.0, [], finish=False),  # never served: misses, not finished
    ]
    events = [
        {"time": 1.0, "step": 3, "kind": "mode_fast", "amount": 30, "reason": ""},
        {"time": 1.5, "step": 5, "kind": "restore_start", "amount": 30, "reason": ""},
        {"time": 2.25, "step": 7, "kind": "restore_done", "amount": 30, "reason": ""},
        {"time": 3.0, "step": 9, "kind": "mode_full", "amount": 30, "reason": ""},
        {"time": 3.0, "step": 9, "kind": "demote", "amount": 4, "reason": ""},
    ]
    result = ReplayResult(records, events=events, duration=4.0)
    s = summarize(result, t_base=0.1, name="p", rate=2.0)
    assert s["requests"] == 4 and s["finished"] == 3
    assert s["attainment"] == pytest.approx(0.25)
    assert s["achieved_rate"] == pytest.approx(3 / 4.0)
    assert s["ttft_mean"] == pytest.approx((1.0 + 2.5 + 0.5) / 3)
    assert s["ttft_p50"] == pytest.approx(1.0)
    assert s["tpot_mean"] == pytest.approx((0.1 + 0.1 + 0.4) / 3)
    assert s["tbt_max"] == pytest.approx(0.7)
    # top-10 % gaps: k = 1 for every request here -> max gap each; request 1 has one gap 0.1
    assert s["tbt_top10_mean"] == pytest.approx((0.1 + 0.1 + 0.7) / 3)
    assert s["eff300"] == pytest.approx(2 / 4)  # requests 0 and 1: tail TBT < 0.3 and TTFT < 30
    assert s["preemptions"] == 1
    assert s["base_exposure"] == pytest.approx(0.3)
    assert s["time_fast_s"] == pytest.approx(2.0) and s["time_full_s"] == pytest.approx(2.0)
    assert s["fast_fraction"] == pytest.approx(0.5)
    assert (s["transitions_to_fast"], s["transitions_to_full"]) == (1, 1)
    assert s["restore_latency_mean"] == pytest.approx(0.75)
    assert s["demoted_pairs"] == 4
    # A replay that starts in fast mode (static-fp8 switches during the T_base run) counts fast time from 0.
    fast_start = summarize(ReplayResult(records, duration=4.0, stats_before={"mode": "fast"}), t_base=0.1)
    assert fast_start["fast_fraction"] == 1.0 and fast_start["transitions_to_fast"] == 0
    # Per-layer restores: three layers start in FP8 and come back one at a time at 1, 2 and 3 s; the replica is in
    # fast mode (some layer in FP8) until the last one is back, not until the first.
    per_layer = [{"time": t, "step": int(t), "kind": "mode_full", "amount": 1, "reason": ""} for t in (1.0, 2.0, 3.0)]
    layered = summarize(ReplayResult(records, events=per_layer, duration=4.0,
                                     stats_before={"mode": "fast", "fast_layers": [0, 1, 2]}), t_base=0.1)
    assert layered["time_fast_s"] == pytest.approx(3.0) and layered["time_full_s"] == pytest.approx(1.0)
    rows = per_request(records, 0.1)
    assert [r["meets_slo"] for r in rows] == [True, False, False, False]
    assert (
        capacity(
            [
                {"rate": 1.0, "attainment": 0.95},
                {"rate": 2.0, "attainment": 0.91},
                {"rate": 3.0, "attainment": 0.5},
                {"rate": 4.0, "attainment": 0.95},
            ]
        )
        == 2.0
    )


def test_prompts_have_exact_lengths_and_avoid_eos():
    requests = build_requests(WorkloadSpec(kind="fixed", rate=4.0, num_requests=5, input_len=37, output_len=3))
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [(37, 3)] * 5
    assert requests[0].arrival == 0.0 and all(a.arrival <= b.arrival for a, b in itertools.pairwise(requests))
    prompts = make_prompts(requests, 260, avoid=frozenset({EOS}), seed=3)
    assert [len(p) for p in prompts] == [37] * 5
    assert all(0 <= t < 260 and t != EOS for p in prompts for t in p)
    assert prompts == make_prompts(requests, 260, avoid=frozenset({EOS}), seed=3)  # deterministic


def test_shared_prefix_prompts():
    """``shared_prefix`` ids open every prompt (all of a shorter one); the rest differ; lengths stay exact."""
    requests = [Request(i, 0.0, n, 2) for i, n in enumerate((30, 12, 25))]
    prompts = make_prompts(requests, 260, avoid=frozenset({EOS}), seed=5, shared_prefix=20)
    assert [len(p) for p in prompts] == [30, 12, 25]
    assert prompts[0][:20] == prompts[2][:20] and prompts[1] == prompts[0][:12]
    assert prompts[0][20:25] != prompts[2][20:25]
    with pytest.raises(ConfigError, match="shared_prefix"):
        WorkloadSpec(shared_prefix=-1)


def test_trace_window_and_clipping():
    spec = WorkloadSpec(
        kind="trace", trace="azure-window", start=0, count=6, time_scale=0.5, max_prompt=50, max_output=7
    )
    requests = build_requests(spec)
    assert len(requests) == 6 and requests[0].arrival == 0.0
    assert max(r.prompt_tokens for r in requests) <= 50 and max(r.output_tokens for r in requests) <= 7
    # Azure rows 0 and 1 are 4.31 s apart; time_scale 0.5 halves it.
    assert requests[1].arrival == pytest.approx(0.5 * 4.3145788, abs=1e-3)


def test_fp8_layer_time_weights_time_by_the_layers_in_fp8():
    # 1 s with no layer, 2 s with 16 of 32 layers, then 32 of 32 until the end at 5 s: 0 + 1.0 + 2.0 = 3.0 s.
    samples = [{"t": 0.0, "fast_layers": [], "num_layers": 32},
               {"t": 1.0, "fast_layers": list(range(16)), "num_layers": 32},
               {"t": 3.0, "fast_layers": list(range(32)), "num_layers": 32}]
    assert fp8_layer_time(samples, 5.0) == pytest.approx(3.0)
    assert fp8_layer_time([{"t": 0.0, "fast_layers": [1]}], 5.0) == 0.0  # no layer count: not reported


def test_open_loop_replay_times_every_token():
    engine = FakeEngine(num_blocks=64)
    requests = [Request(i, 0.02 * i, 6, 4) for i in range(5)]
    result = replay_in_process(engine, requests, make_prompts(requests, 256))
    assert [len(r.token_times) for r in result.records] == [4] * 5
    assert all(r.finished and r.ttft > 0 and r.token_times == sorted(r.token_times) for r in result.records)
    assert all(r.token_times[0] >= r.arrival for r in result.records)  # never served before it arrives
    assert result.samples and result.samples[-1]["num_used_blocks"] == 0
    assert not engine.has_unfinished()


def test_replay_settles_background_work_before_the_next_point():
    # The H200 MoE sweep began its rate-12 point with 28 layers still in FP8 from the rate-8 point.
    engine = FakeEngine(num_blocks=64)
    requests = [Request(0, 0.0, 6, 2)]
    engine.background_steps = 50  # far more than the two decode steps the request needs
    result = replay_in_process(engine, requests, make_prompts(requests, 256))
    assert result.records[0].finished
    assert not engine.has_background_work() and result.settle_s >= 0.0
    assert engine.num_steps >= 50


def test_closed_loop_replay_respects_concurrency():
    engine = FakeEngine(num_blocks=64, max_num_seqs=8)
    requests = [Request(i, 0.0, 4, 5) for i in range(7)]
    result = replay_in_process(engine, requests, make_prompts(requests, 256), concurrency=2)
    assert max(s["num_running"] + s["num_waiting"] for s in result.samples) <= 2
    assert all(r.finished for r in result.records)


def test_short_bench_run_writes_json_and_plots(tmp_path):
    plan = BenchPlan(
        WorkloadSpec(kind="fixed", rate=50.0, num_requests=6, input_len=9, output_len=5),
        policies=("static-fp16", "dps"),
        rates=(20.0, 80.0),
        out_dir=tmp_path,
        progress=False,
        tag="t",
        settings={"block_size": 4},
    )
    engines = []
    out = run_bench(plan, engine_factory=lambda policy: engines.append(FakeEngine(num_blocks=64)) or engines[-1],
                    model="fake")
    assert [e.closed for e in engines] == [True, True]  # each policy's engine gives its memory back before the next
    data = json.loads((tmp_path / "t.json").read_text())
    meta = data["metadata"]
    assert meta["commit"] and meta["device"].startswith(("cpu", "nvidia", "amd")) and meta["model"] == "fake"
    assert meta["settings"]["engine"] == {"block_size": 4}
    assert meta["settings"]["plan"]["workload"]["input_len"] == 9
    assert [(r["policy"], r["rate"]) for r in data["runs"]] == [
        ("static-fp16", 20.0),
        ("static-fp16", 80.0),
        ("dps", 20.0),
        ("dps", 80.0),
    ]
    for run in data["runs"]:
        assert run["summary"]["finished"] == 6 and run["summary"]["t_base"] > 0
        assert [r["output_tokens"] for r in run["requests"]] == [5] * 6
    assert set(data["capacity"]) == {"static-fp16", "dps"}
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["t_rate_sweep.png", "t_timeline.png"] and out["plots"]
    for p in tmp_path.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_bench_run_on_real_engine(tmp_path):
    """SmolLM2 on the CPU: a 3-request window replayed in-process; every token arrives and the JSON is complete."""
    from elastiserve.engine.cli import make_engine

    plan = BenchPlan(
        WorkloadSpec(kind="fixed", rate=100.0, num_requests=3, input_len=12, output_len=3),
        policies=("static-fp16",),
        out_dir=tmp_path,
        progress=False,
        tag="real",
        t_base=0.5,
        settings={"device": "cpu", "max_model_len": 128, "cpu_kv_blocks": 32},
    )
    out = run_bench(plan, engine_factory=lambda p: make_engine("smollm2", p, plan.settings), model="smollm2")
    summary = out["runs"][0]["summary"]
    assert summary["finished"] == 3 and summary["t_base"] == 0.5
    assert all(r["output_tokens"] == 3 and r["prompt_tokens"] == 12 for r in out["runs"][0]["requests"])
    assert out["runs"][0]["stats_after"]["free_blocks"] == out["runs"][0]["stats_after"]["total_blocks"]
    assert math.isfinite(summary["ttft_mean"]) and (tmp_path / "real_timeline.png").is_file()


def test_http_bench_against_server(tmp_path):
    """The HTTP client path: stream every request from a live server on 127.0.0.1, open loop then closed loop."""
    from elastiserve.engine.async_engine import AsyncEngine
    from elastiserve.engine.server import BackgroundServer, build_app

    engine = FakeEngine(num_blocks=128)
    async_engine = AsyncEngine(engine).start()
    try:
        with BackgroundServer(build_app(async_engine, engine.tokenizer, model_name="fake")) as server:
            for concurrency in (None, 2):
                plan = BenchPlan(WorkloadSpec(kind="fixed", rate=40.0, num_requests=5, input_len=7, output_len=6),
                                 concurrencies=(concurrency,) if concurrency else (), out_dir=tmp_path,
                                 progress=False, plots=False, tag=f"http{concurrency}")
                out = run_bench(plan, url=server.base_url, model="fake", vocab_size=250)
                summary = out["runs"][0]["summary"]
                assert summary["finished"] == 5 and summary["t_base"] > 0
                # The fake script is ASCII at first: one streamed chunk per token.
                assert [r["output_tokens"] for r in out["runs"][0]["requests"]] == [6] * 5
                assert out["metadata"]["settings"]["mode"] == "http"
    finally:
        async_engine.shutdown()
    assert engine.used_blocks == 0


def test_demo_smoke(tmp_path):
    """``elastiserve demo`` shrunk to three requests and two policies: one table row per policy, JSON and plot."""
    from elastiserve.engine.bench.demo import DemoSettings, run_demo

    settings = DemoSettings(count=3, max_prompt=24, max_output=3, kv_blocks=16)
    text = run_demo(tmp_path, policies=("static-fp16", "elastickv"), settings=settings, progress=False)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["policy", "done"])
    assert [lines[header + 1].split()[:2], lines[header + 2].split()[:2]] == [["static-fp16", "3/3"],
                                                                              ["elastickv", "3/3"]]
    data = json.loads((tmp_path / "demo.json").read_text())
    assert [r["policy"] for r in data["runs"]] == ["static-fp16", "elastickv"]
    assert data["metadata"]["settings"]["engine"]["cpu_kv_blocks"] == 16
    assert (tmp_path / "demo_timeline.png").is_file() and (tmp_path / "demo.txt").read_text().strip() == text
