"""``elastiserve`` command line: size parsing ("80GB" decimal, "20GiB" binary), every serve flag reaching the engine
config, bench flags becoming a plan, and ``generate`` end to end on a JSONL file (fake engine; and SmolLM2)."""

from __future__ import annotations

import argparse
import json

import pytest
from fake_engine import SCRIPT, FakeEngine

from elastiserve.engine import cli
from elastiserve.engine.bench.cli_args import plan_from_args

pytestmark = [pytest.mark.cpu]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("20GiB", 20 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5G", 1_500_000_000),
        ("4096", 4096),
        ("64kib", 64 * 1024),
        (" 2 TB ", 2 * 10**12),
    ],
)
def test_parse_size(text, expected):
    assert cli.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "12XB", "-1GB", "3iB", "1,5GB"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_size(text)


def test_serve_flags_reach_engine_settings():
    args = cli.build_parser().parse_args(
        [
            "serve",
            "smollm2",
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--api-key",
            "k",
            "--policy",
            "combined",
            "--block-size",
            "32",
            "--gpu-memory-utilization",
            "0.8",
            "--gpu-memory-budget",
            "80GB",
            "--kv-cache-budget",
            "20GiB",
            "--host-backing-budget",
            "8GiB",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "4096",
            "--tensor-parallel-size",
            "2",
            "--load-format",
            "dummy",
            "--enforce-eager",
            "--graph-capture-after",
            "3",
            "--mixed-graphs",
            "--max-step-time",
            "0.11",
            "--queue-fast-after",
            "0.5",
            "--queue-fast-hold",
            "0.25",
            "--prefill-fast",
            "--no-gc-shadow",
            "--nest-lm-head",
            "--lm-head-exact-top",
            "16",
            "--scheduling-policy",
            "priority",
            "--device",
            "cpu",
        ]
    )
    assert (args.command, args.model, args.host, args.port, args.api_key, args.policy) == (
        "serve",
        "smollm2",
        "0.0.0.0",
        9001,
        "k",
        "combined",
    )
    assert cli.engine_settings(args) == {
        "device": "cpu",
        "dtype": "float16",
        "block_size": 32,
        "gpu_memory_utilization": 0.8,
        "gpu_memory_budget": 80 * 10**9,
        "kv_cache_budget": 20 * 2**30,
        "host_backing_bytes": 8 * 2**30,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 4096,
        "max_model_len": None,
        "tensor_parallel_size": 2,
        "load_format": "dummy",
        "enforce_eager": True,
        "graph_capture_after": 3,
        "max_step_time_s": 0.11,
        "queue_fast_after_s": 0.5,
        "queue_fast_hold_s": 0.25,
        "prefill_fast": True,
        "nest_lm_head": True,
        "lm_head_exact_top": 16,
        "mixed_graphs": True,
        "enable_prefix_caching": False,
        "gc_in_step_shadow": False,
        "seed": 0,
        "cpu_kv_blocks": 512,
        "scheduling_policy": "priority",
    }
    from elastiserve.engine.config import EngineConfig

    config = EngineConfig(model=args.model, policy=args.policy, **cli.engine_settings(args))
    assert config.kv_cache_budget == 20 * 2**30 and config.policy == "combined"


def test_vllm_dtype_spellings_map_to_fp16_and_other_types_are_refused_with_the_reason(capsys):
    for spelling in ("auto", "half", "float16"):
        args = cli.build_parser().parse_args(["serve", "m", "--dtype", spelling, "--kv-cache-dtype", "auto"])
        assert cli.engine_settings(args)["dtype"] == "float16"
    for flag, value, reason in (("--dtype", "bfloat16", "computes in float16"),
                                ("--kv-cache-dtype", "fp8", "demotes pairs of blocks")):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", "m", flag, value])
        assert reason in capsys.readouterr().err


def test_serve_rejects_unknown_policy(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "m", "--policy", "fp4"])
    assert "invalid choice" in capsys.readouterr().err


def test_bench_flags_make_a_plan(tmp_path):
    args = cli.build_parser().parse_args(
        [
            "bench",
            "smollm2",
            "--policies",
            "dps",
            "--policies",
            "static-fp16",
            "--workload",
            "gamma",
            "--rate",
            "1",
            "--rate",
            "2.5",
            "--cv",
            "2",
            "--trace",
            "azure-window",
            "--count",
            "40",
            "--out",
            str(tmp_path),
            "--max-output",
            "64",
        ]
    )
    plan = plan_from_args(args, {"device": "cpu"})
    assert plan.policies == ("dps", "static-fp16") and plan.rates == (1.0, 2.5)
    assert plan.workload.kind == "gamma" and plan.workload.cv == 2.0 and plan.workload.count == 40
    assert plan.workload.max_output == 64 and plan.out_dir == tmp_path and plan.settings == {"device": "cpu"}
    fixed = plan_from_args(
        cli.build_parser().parse_args(
            [
                "bench",
                "m",
                "--workload",
                "fixed",
                "--rate",
                "3",
                "--input-len",
                "4096",
                "--output-len",
                "1024",
                "--concurrency",
                "8",
                "--concurrency",
                "16",
            ]
        ),
        {},
    )
    assert fixed.workload.input_len == 4096 and fixed.concurrencies == (8, 16) and fixed.workload.rate == 3.0
    assert fixed.points() == [(None, 8), (None, 16)]


def test_serve_wires_the_reasoning_parser_and_chat_template(tmp_path, monkeypatch, capsys):
    from elastiserve.engine import server
    from elastiserve.engine.loader import smollm2_dir
    from elastiserve.engine.server_generation import STATE_KEY
    from elastiserve.engine.tokenizer import Tokenizer

    engine, apps = FakeEngine(), []
    engine.tokenizer = Tokenizer.from_dir(smollm2_dir())
    monkeypatch.setattr(cli, "make_engine", lambda model, policy, settings: engine)
    monkeypatch.setattr(server, "run_forever", lambda app, socks: apps.append(app))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    model = tmp_path / "model"  # a model folder whose generation config the server takes its defaults from
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "do_sample": True}))
    serve = ["serve", str(model), "--port", "0"]  # the socket is bound for real: any free port
    assert cli.main([*serve, "--reasoning-parser", "deepseek_r1", "--chat-template", str(template)]) == 0
    assert apps[0][STATE_KEY].reasoning.name == "deepseek_r1"
    assert apps[0][STATE_KEY].default_sampling == {"temperature": 0.6, "top_k": 20}
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    assert cli.main([*serve, "--generation-config", "none"]) == 0
    assert apps[-1][STATE_KEY].default_sampling == {}
    assert cli.main([*serve, "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err and len(apps) == 2 and engine.closed


def test_serve_refuses_a_port_in_use_or_out_of_range_before_the_model_loads(monkeypatch, capsys):
    import socket

    built = []
    monkeypatch.setattr(cli, "make_engine", lambda *a: built.append(a) or FakeEngine())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert cli.main(["serve", "fake", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err and not built
    with pytest.raises(SystemExit):  # argparse's usage error, exit status 2
        cli.main(["serve", "fake", "--port", "99999"])
    assert "port 99999 is outside 0-65535" in capsys.readouterr().err and not built


def test_generate_writes_jsonl(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "make_engine", lambda model, policy, settings: FakeEngine())
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "hello"},
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                {"prompt_token_ids": [1, 2, 3], "max_tokens": 200},
            ]
        )
        + "\n"
    )
    out = tmp_path / "out" / "o.jsonl"
    assert cli.main(["generate", "fake", "--input", str(prompts), "--output", str(out), "--max-tokens", "5"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert rows[0]["text"] == SCRIPT[:5] and rows[0]["finish_reason"] == "length"
    assert rows[1]["text"] == SCRIPT[:3] and rows[1]["input"]["messages"][0]["content"] == "hi"
    assert rows[2]["text"] == SCRIPT and rows[2]["finish_reason"] == "stop"


def test_generate_on_smollm2(tmp_path):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": "The capital of France is"}) + "\n"
                       + json.dumps({"prompt": "one one one one", "logprobs": 2, "repetition_penalty": 1.5}) + "\n"
                       + json.dumps({"prompt": "The capital of France is", "logit_bias": {"42": 100}}) + "\n")
    out = tmp_path / "o.jsonl"
    assert (
        cli.main(
            [
                "generate",
                "smollm2",
                "--device",
                "cpu",
                "--max-model-len",
                "128",
                "--input",
                str(prompts),
                "--output",
                str(out),
                "--max-tokens",
                "4",
            ]
        )
        == 0
    )
    row, scored, biased = [json.loads(line) for line in out.read_text().splitlines()]
    assert biased["token_ids"] == [42] * 4  # greedy with +100 on one token (the file's own logit_bias)
    assert len(row["token_ids"]) == 4 and "Paris" in row["text"] and "logprobs" not in row
    assert [entry[0] for entry in scored["logprobs"]] == scored["token_ids"]  # a line's own sampling fields apply
    assert all(entry[1] <= 0 and len(entry[2]) == 2 for entry in scored["logprobs"])


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "a"}', '{"prompt": "b",}'], "line 2: not JSON"),
        (['["a"]'], "line 1: expected a JSON object, got list"),
        (['{"text": "a"}'], "line 1: expected exactly one of 'prompt', 'messages' or 'prompt_token_ids'"),
        (['{"prompt": "a", "prompt_token_ids": [1]}'], "(it has prompt, prompt_token_ids)"),
        (['{"prompt": [1, 2]}'], "'prompt' must be a string, got list"),
        (['{"prompt_token_ids": [1, "2"]}'], "'prompt_token_ids' must be a list of integers"),
        (['{"messages": [{"content": "hi"}]}'], "messages[0] must be an object with a string 'role'"),
        (['{"prompt": "a"}', "", '{"prompt": "a", "max_tokens": "5"}'], "line 3: 'max_tokens' must be an integer"),
        (['{"prompt": "a", "temperature": -1}'], "temperature=-1.0 must be >= 0"),
        (['{"prompt": "a", "temperature": NaN}'], "'temperature' must be a finite number"),
        (['{"prompt": "a", "logprobs": 21}'], "'logprobs' must be between 0 and 20"),
        (['{"prompt": "a", "stop": [""]}'], "'stop' must be a non-empty string"),
        (['{"prompt": "a", "logit_bias": {"x": 1}}'], "'logit_bias' keys must be token ids"),
        (['{"prompt": "a", "n": 65}'], "'n' must be between 1 and 64, got 65"),
        (['{"prompt": "a", "n": 3, "best_of": 2}'], "'best_of' must be between n (3) and 64, got 2"),
        (['{"prompt": "a", "best_of": 2}'], "'best_of' above 'n' needs sampling"),  # --temperature's default: 0
        ([], "holds no request"),
    ],
)
def test_generate_checks_the_whole_file_before_the_model_loads(tmp_path, monkeypatch, capsys, lines, message):
    """A bad line is exit status 2 and one message naming the file and line, before any model is built (the server's
    field readers: the same words as its 400s)."""
    built = []
    monkeypatch.setattr(cli, "make_engine", lambda *a: built.append(a) or FakeEngine())
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o.jsonl"
    assert cli.main(["generate", "fake", "--input", str(prompts), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(prompts) in err and not built and not out.exists(), err


def test_generate_refuses_bad_flags_and_a_missing_file_before_the_model_loads(tmp_path, monkeypatch, capsys):
    built = []
    monkeypatch.setattr(cli, "make_engine", lambda *a: built.append(a) or FakeEngine())
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    out = str(tmp_path / "o.jsonl")
    assert cli.main(["generate", "fake", "--input", str(prompts), "--output", out, "--top-k", "0"]) == 2
    assert "the sampling flags: top_k=0" in capsys.readouterr().err
    assert cli.main(["generate", "fake", "--input", str(tmp_path / "missing.jsonl"), "--output", out]) == 2
    assert "missing.jsonl" in capsys.readouterr().err and not built


def test_a_line_the_model_refuses_stops_generate_before_any_step_and_frees_the_engine(tmp_path, monkeypatch, capsys):
    """The checks that need the model (here the fake's 512-token context) run as requests are added: none of them
    runs, the engine is closed, no output is written."""
    engine = FakeEngine()
    monkeypatch.setattr(cli, "make_engine", lambda *a: engine)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt_token_ids": [1] * 500}) + "\n")
    out = tmp_path / "o.jsonl"
    assert cli.main(["generate", "fake", "--input", str(prompts), "--output", str(out), "--max-tokens", "20"]) == 2
    err = capsys.readouterr().err
    assert "line 2: prompt (500 tokens) + max_tokens (20) exceeds max_model_len 512" in err, err
    assert engine.closed and engine.num_steps == 0 and not out.exists()
