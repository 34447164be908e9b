"""``benchmarks/serving/headline.py`` smoke on the CPU with tiny random models: the dense setting (closed-loop
concurrency sweep) and the moe setting (Gamma-arrival rate sweep with T_base measured as the P99 decode step in the
same run) both finish every request, print what was reduced, write one JSON per policy plus the headline JSON, and
``--summarize`` rebuilds the same table from the files (a policy's finished points alone when its JSON is
missing). Only the policies without nested weights run here: under pytest the nested GEMM runs in the Triton
interpreter."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving" / "headline.py"
COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
LLAMA = {"architectures": ["LlamaForCausalLM"], **COMMON}
QWEN_MOE = {"architectures": ["Qwen3MoeForCausalLM"], **COMMON, "moe_intermediate_size": 32, "num_experts": 4,
            "num_experts_per_tok": 2}
SMOKE = ["--device", "cpu", "--requests", "5", "--scale", "0.01", "--max-model-len", "128", "--no-progress",
         "--no-plots", "--policies", "static-fp16", "elastickv"]


def load_script():
    spec = importlib.util.spec_from_file_location("headline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["headline"] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


def check_policy_files(out: Path, setting: str, points: list[tuple]) -> list[dict]:
    datas = [json.loads((out / f"{setting}-{p}.json").read_text()) for p in ("static-fp16", "elastickv")]
    for data in datas:
        assert [(r["rate"], r["concurrency"]) for r in data["runs"]] == points
        for run in data["runs"]:
            s = run["summary"]
            assert s["finished"] == s["requests"] == 5 and s["t_base"] > 0
            for key in ("preemptions", "ttft_mean", "ttft_p90", "tpot_mean", "base_exposure", "time_fast_s"):
                assert s[key] is not None
    return datas


def test_dense_smoke(tmp_path, capsys):
    headline = load_script()
    result = headline.main(["--setting", "dense", "--out", str(tmp_path), "--model", json.dumps(LLAMA),
                            "--concurrency", "2", "--concurrency", "4", "--cpu-kv-blocks", "16", *SMOKE])
    printed = capsys.readouterr().out
    assert "REDUCED:" in printed and "requests: 600 -> 5" in printed and "input_len: 4096 -> 41" in printed
    assert "kv_cache_budget: 20000000000 -> 200000000" in printed
    assert "concurrencies: (64, 128, 256) -> (2, 4)" in printed
    datas = check_policy_files(tmp_path, "dense", [(None, 2), (None, 4)])
    assert all(r["prompt_tokens"] == 41 and r["output_tokens"] == 10 for d in datas for run in d["runs"]
               for r in run["requests"])
    head = json.loads((tmp_path / "headline-dense.json").read_text())
    assert head["config"]["input_len"] == 41 and head["config"]["output_len"] == 10 and head["reductions"]
    assert len(result["table"].splitlines()) == 1 + 2 * 2  # header + (policy x concurrency)
    assert {row["capacity"] for row in headline.summary_rows(datas)} == {"-"}  # a closed loop has no capacity
    again = headline.main(["--setting", "dense", "--out", str(tmp_path), "--summarize"])
    assert sorted(again["table"].splitlines()) == sorted(result["table"].splitlines())
    # a policy cut before its JSON (a GPU call's time limit) keeps its finished points in the table
    (tmp_path / "dense-elastickv.json").unlink()
    cut = headline.main(["--setting", "dense", "--out", str(tmp_path), "--summarize", "--no-plots"])
    assert sorted(cut["table"].splitlines()) == sorted(result["table"].splitlines())


def test_moe_smoke(tmp_path, capsys):
    headline = load_script()
    headline.main(["--setting", "moe", "--out", str(tmp_path), "--model", json.dumps(QWEN_MOE), "--rate", "20",
                   "--rate", "80", *SMOKE])
    printed = capsys.readouterr().out
    assert "T_base = P99 decode step, batch 32 at 41 tokens, on the static-fp16 engine" in printed
    datas = check_policy_files(tmp_path, "moe", [(20.0, None), (80.0, None)])
    measured = datas[0]["metadata"]["settings"]["engine"]["t_base_measurement"]
    assert measured["batch"] == 32 and measured["context"] == 41 and measured["steps"] > 10
    # the same T_base (measured once, on the first engine) judges every policy
    assert {run["summary"]["t_base"] for d in datas for run in d["runs"]} == {measured["p99_s"]}
    assert all(r["prompt_tokens"] <= 118 and r["output_tokens"] <= 10 for d in datas for run in d["runs"]
               for r in run["requests"])
    assert set(json.loads((tmp_path / "headline-moe.json").read_text())["capacity"]) == {"static-fp16", "elastickv"}
    assert [row["capacity"] for row in headline.summary_rows(datas)] == [
        f"{d['capacity'][d['runs'][0]['policy']]:g}" for d in datas for _ in d["runs"]]


def test_queue_and_prefill_fast_settings_reach_only_the_switching_policies():
    headline = load_script()
    args = headline.parse_args(["--setting", "dense", "--out", "x", "--queue-fast-after", "0.1",
                                "--queue-fast-hold", "0.25"])
    settings = {"device": "cpu"}
    assert headline.policy_settings(settings, "combined", args) == {
        "device": "cpu", "queue_fast_after_s": 0.1, "queue_fast_hold_s": 0.25}
    assert headline.policy_settings(settings, "elastickv", args) == settings
    args = headline.parse_args(["--setting", "dense", "--out", "x", "--prefill-fast"])
    assert headline.policy_settings(settings, "dps", args) == {"device": "cpu", "prefill_fast": True}
    assert headline.policy_settings(settings, "static-fp16", args) == settings
    with pytest.raises(SystemExit):  # a hold without the queue rule is refused, not dropped
        headline.parse_args(["--setting", "dense", "--out", "x", "--queue-fast-hold", "0.25"])


class _QueueRuleEngine:
    """Just what ``p99_decode_step`` touches: prompts prefill in one step, then the queue rule's hold keeps every
    layer fast for ``hold_steps`` more steps, as EngineConfig.queue_fast_hold_s does."""

    def __init__(self, hold_steps: int, queue_rule: bool = True):
        from types import SimpleNamespace

        self.config = SimpleNamespace(queue_fast_after_s=0.1 if queue_rule else None)
        self.scheduler = SimpleNamespace(waiting=[], running=[], num_preemptions=0)
        self.transitions = SimpleNamespace(queue_fast=False)
        self.runner = SimpleNamespace(fast_layers=frozenset())
        self.max_model_len, self.vocab_size, self.hold_steps, self.max_tokens = 8192, 256, hold_steps, None

    def add_request(self, rid, prompt, params):
        self.scheduler.waiting.append(rid)
        self.max_tokens = params.max_tokens

    def step(self):
        if self.scheduler.waiting:  # the prefill step: prompts waited, the rule turns on
            self.scheduler.waiting.clear()
            self.transitions.queue_fast = self.config.queue_fast_after_s is not None
        elif self.transitions.queue_fast:
            self.hold_steps -= 1
            self.transitions.queue_fast = self.hold_steps > 0
        self.runner.fast_layers = frozenset(range(2)) if self.transitions.queue_fast else frozenset()

    def abort_request(self, rid):
        pass


def test_t_base_waits_for_the_queue_rule_to_let_go():
    """With --queue-fast-after, the T_base prompts' own wait turns every layer fast; the measurement steps through
    the hold first, so T_base is a full-precision step."""
    headline = load_script()
    held = headline.p99_decode_step(_QueueRuleEngine(hold_steps=30), batch=4, context=128, steps=16)
    assert held["settle_steps"] == 30 and held["layers_in_fast_mode"] == 0 and held["steps"] == 16
    plain = headline.p99_decode_step(_QueueRuleEngine(hold_steps=30, queue_rule=False), batch=4, context=128, steps=16)
    assert plain["settle_steps"] == 0 and plain["layers_in_fast_mode"] == 0
    short = _QueueRuleEngine(hold_steps=30)
    short.max_model_len = 128  # 400 settle steps do not fit: settle what does, with a prompt token left
    tight = headline.p99_decode_step(short, batch=4, context=128, steps=16)
    assert tight["context"] >= 1 and tight["settle_steps"] == 30 and tight["layers_in_fast_mode"] == 0
