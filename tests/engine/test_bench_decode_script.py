"""``benchmarks/engine/bench_decode.py`` end to end on a tiny random Llama on the CPU: all four parts run, the JSON has
every section and setting, the switch run advances every request by one token per step with the mode applied at the
next step, and the throughput part replays every requested ShareGPT-length request for each policy given.

Under pytest on the CPU the nested GEMM runs in the Triton interpreter (seconds per step), so the throughput part
runs the two policies without nested weights; (b) and (c) run the DPS engine in both modes. A plain
``--device cpu`` run (reference kernels) covers all five policies in a few seconds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine" / "bench_decode.py"
TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}  # fmt: skip
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def load_script():
    sys.path.insert(0, str(SCRIPT.parent))  # it imports its helpers from decode_setup.py beside it
    try:
        spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_bench_decode_main_on_a_tiny_config(tmp_path):
    out = tmp_path / "decode.json"
    argv = ["--device", "cpu", "--model", json.dumps(TINY), "--requests", "8", "--batch", "1", "2", "--context", "12",
            "--iters", "2", "--trials", "2", "--switch-batch", "2", "--switch-steps", "4", "--max-model-len", "64",
            "--policies", "static-fp16", "elastickv", "--fp8-min-rows-quantized", "1", "--out", str(out),
            "--queue-fast-after", "0.5",  # dropped for these two, which never switch precision
            "--nest-lm-head",  # (b) and (c): the DPS engine's lm_head nested, fast with the last layer
            "--lm-head-exact-top", "4",  # ... keeping its 4 largest logits a row exact in fast mode
            "--attention-stages", "3", "--quant-split-rows", "1", "64"]
    if TRACES.is_dir():
        argv += ["--trace-dir", str(TRACES)]
    from elastiserve.kernels import attention, fp8_activations, nested_gemm

    stages = attention.NUM_STAGES
    thresholds = dict(nested_gemm.FP8_MIN_M_QUANTIZED_INPUT)
    split_rows = dict(fp8_activations.QUANT_SPLIT_ROWS)
    load_script().main(argv)
    data = json.loads(out.read_text())
    assert set(data) == {"metadata", "roofline", "fp16_steps", "fast_full", "fast_full_target", "switch", "throughput",
                         "wall_s"}
    meta = data["metadata"]
    assert {"device", "torch", "triton", "commit", "settings"} <= set(meta) and len(meta["commit"]) == 40
    assert meta["settings"]["batches"] == [1, 2] and meta["settings"]["device"] == "cpu"
    assert meta["settings"]["queue_fast_after"] == 0.5
    assert meta["settings"]["fp8_min_rows_quantized"] == 1 and meta["settings"]["nest_lm_head"] is True
    assert meta["settings"]["lm_head_exact_top"] == 4
    assert thresholds == nested_gemm.FP8_MIN_M_QUANTIZED_INPUT, "the run restores the routing table"
    assert meta["settings"]["quant_split_rows"] == [1, 64] and split_rows == fp8_activations.QUANT_SPLIT_ROWS
    assert meta["settings"]["attention_stages"] == 3 and stages == attention.NUM_STAGES
    roof = data["roofline"]
    assert roof["step_s"] > 0 and roof["copy"]["bytes_per_s"] > 0 and roof["fraction"] > 0
    # per layer: qkv 64x128, o 64x64, gate_up 64x192, down 96x64, two norms; then the final norm and lm_head 256x64
    per_layer = 64 * 128 + 64 * 64 + 64 * 192 + 96 * 64 + 2 * 64
    assert roof["weight_bytes"] == 2 * (2 * per_layer + 64 + 256 * 64)
    assert roof["kv_bytes"] == 13 * 2 * 2 * 2 * 16 * 2  # 12 prompt tokens + 1, layers, k|v, kv heads, head dim
    assert [r["batch"] for r in data["fast_full"]] == [1, 2]
    assert all(r["full_s"] > 0 and r["fast_s"] > 0 and r["fast_speedup"] > 0 for r in data["fast_full"])
    switch = data["switch"]
    assert switch["applies_next_step"] and switch["no_recompute"] and switch["problems"] == []
    assert len(switch["steps"]) == 4 * 4 and len(switch["switches"]) == 3
    assert [r["fast_layers"] for r in switch["steps"][::4]] == [0, 2, 0, 2]
    tp = data["throughput"]
    assert [r["policy"] for r in tp["policies"]] == ["static-fp16", "elastickv"]
    tokens = {r["output_tokens"] for r in tp["policies"]}
    assert len(tokens) == 1 and tokens.pop() > 8  # every policy produced the same exact-length outputs
    assert all(r["requests"] == 8 and r["output_tokens_per_s"] > 0 for r in tp["policies"])
    for r in tp["policies"]:  # the loop watch: the interpreter compiles nothing, the CPU captures no graph
        assert r["compiles_in_loop"] == 0 and r["compiled_kernels"] == [] and r["graphs_captured_in_loop"] == 0
        assert 0 < r["step_s"]["median"] <= r["step_s"]["max"] and r["step_s"]["sum"] <= r["total_s"]
        assert 0 < r["fast_steps"] + r["full_steps"] <= r["steps"]  # the steps that ran a batch
        assert r["fast_step_s_sum"] + r["full_step_s_sum"] == pytest.approx(r["step_s"]["sum"])
        assert r["fast_steps"] == 0  # static-fp16 and elastickv never run a layer in FP8


def test_l2_prefetch_flag_replaces_the_arch_row_per_mode():
    module = load_script()
    base = ["--device", "cpu", "--model", json.dumps(TINY), "--out", "unused.json"]
    assert module.parse_args(base).l2_prefetch is None  # the table's
    assert module.parse_args([*base, "--l2-prefetch"]).l2_prefetch == []  # off
    shares = module.parse_args([*base, "--l2-prefetch", "fp8=0.125", "weight_only=0.25"]).l2_prefetch
    assert dict(shares) == {"fp8": 0.125, "weight_only": 0.25}
    for bad in ("fp16=0.1", "fp8", "fp8=1.5", "fp8=x"):
        with pytest.raises(SystemExit):
            module.parse_args([*base, "--l2-prefetch", bad])


def test_loop_watch_names_what_a_variant_compiled_in_the_loop_differs_in():
    load_script()  # puts benchmarks/engine, and so decode_setup, on the path
    import decode_setup

    warm = ("_k[num_warps=4, num_ctas=1, num_stages=3, enable_fp_fusion=True, launch_cooperative_grid=False]"
            "(x_ptr: *fp16D, M: i32, N: i32D, BLOCK: constexpr[64])")
    other = warm.replace("x_ptr: *fp16D", "x_ptr: *fp16").replace("N: i32D", "N: i32")
    loop = warm.replace("M: i32,", "M: constexpr[1],")
    assert decode_setup.variant_args(loop)["M"] == "constexpr[1]"
    assert decode_setup.variant_args(loop)["options"].startswith("num_warps=4")
    assert decode_setup.variant_difference(loop, [other, warm]) == "M: i32 -> constexpr[1]"  # the nearest one
    assert decode_setup.variant_difference(loop, []) == "first variant of this kernel"
    split = loop + " constexprs(BLOCK=64, SPLIT_K=2)"
    assert decode_setup.variant_args(split)["SPLIT_K"] == "=2"
    assert decode_setup.variant_difference(split, [loop + " constexprs(BLOCK=64, SPLIT_K=1)"]) == "SPLIT_K: =1 -> =2"

    class Info:  # the hook's fn: Triton's JitFunctionInfo
        jit_function = type("Jit", (), {"arg_names": ["x_ptr", "M", "N", "BLOCK"]})

    assert decode_setup.constexpr_suffix(Info, {"constants": {(3,): 64}}) == " constexprs(BLOCK=64)"
    assert decode_setup.constexpr_suffix(Info, {}) == ""


def test_decode_inputs_keeps_every_request_decoding_through_a_long_prefill(tmp_path):
    """Session 30's H200 run at batch 128 x 512 tokens got a step of 97: the first requests decoded while the last
    prefilled and spent their 8 tokens. Here 16 x 40 tokens at 64 tokens a step take 10 steps of prefill."""
    load_script()  # puts benchmarks/engine, and so decode_setup, on the path
    import decode_setup

    from elastiserve.engine.config import EngineConfig
    from elastiserve.engine.llm_engine import LLMEngine

    config = EngineConfig(model=decode_setup.resolve_model(json.dumps(TINY), tmp_path), policy="static-fp16",
                          device="cpu", load_format="dummy", max_num_seqs=16, max_num_batched_tokens=64,
                          max_model_len=128, cpu_kv_blocks=256, enforce_eager=True)
    engine = LLMEngine(config, eos_token_ids=())
    inputs = decode_setup.decode_inputs(engine, 16, 40)
    assert list(inputs.query_lens) == [1] * 16
    assert min(inputs.seq_lens) >= 41  # every prompt computed, each row decoding one more token
    with pytest.raises(RuntimeError, match="finished before the others' prefill"):
        decode_setup.start_decoding(engine, 16, 40, max_tokens=2, tag="short")
