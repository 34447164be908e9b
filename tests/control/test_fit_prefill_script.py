"""``benchmarks/control/fit_prefill.py`` on synthetic runs whose prefill steps follow known coefficients: at two
prompt lengths (the attention term is told apart from the per-token ones only there), plain fp16, nested full,
mixed and all-fast steps (static-fp8's are nested, all fast), the fit recovers the four coefficients; decode steps
(under ``min_tokens``) are left out, and a trace workload, whose prompt lengths the timeline does not carry, is
refused."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from elastiserve.control.step_model import load_step_model

pytestmark = [pytest.mark.cpu]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "control" / "fit_prefill.py"
UNNESTED, FULL, FAST, PER_KEY = 2.4e-5, 2.5e-5, 1.5e-5, 2.1e-9
TOTAL_BLOCKS, LAYERS = 9_536, 32


def load_script():
    sys.path.insert(0, str(SCRIPT.parent))  # it reads the result files with fit_kv_read.py's reader, beside it
    try:
        spec = importlib.util.spec_from_file_location("fit_prefill", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def synthetic_run(path: Path, policy: str, prompt_len: int, kind: str = "fixed") -> None:
    sm = load_step_model("h100")
    rng = random.Random(f"{policy}{prompt_len}")
    timeline = []
    for step in range(120):
        used = rng.randint(500, 9_000)
        fast_layers = {"dps": [0, LAYERS // 2, LAYERS][step % 3], "combined": [0, LAYERS // 2, LAYERS][step % 3],
                       "static-fp8": LAYERS}.get(policy, 0)
        tokens = rng.choice([38, 2048, 4096, 8192])  # 38: a decode-only step, left out
        f = fast_layers / LAYERS
        per_token = UNNESTED if policy in ("static-fp16", "elastickv") else (1 - f) * FULL + f * FAST
        seconds = (sm.host_overhead_s + sm.kv_read_per_token_s * used * 16 + tokens * per_token
                   + PER_KEY * tokens * (prompt_len + 1) / 2)
        timeline.append({"t": step, "total_blocks": TOTAL_BLOCKS, "free_blocks": TOTAL_BLOCKS - used,
                         "fast_layers": list(range(fast_layers)), "num_layers": LAYERS, "step_tokens": tokens,
                         "step_s": seconds})
    workload = {"kind": kind, "input_len": prompt_len}
    path.mkdir(parents=True, exist_ok=True)
    result = {"metadata": {"settings": {"plan": {"workload": workload}}},
              "runs": [{"policy": policy, "timeline": timeline}]}
    (path / f"dense-{policy}.json").write_text(json.dumps(result))


def test_fit_recovers_the_coefficients_it_was_built_from(tmp_path):
    for prompt_len, policies in ((4096, ("static-fp16", "dps", "static-fp8")), (2048, ("elastickv", "combined"))):
        for policy in policies:
            synthetic_run(tmp_path / str(prompt_len), policy, prompt_len)
    script = load_script()
    coefficients, lines = script.fit([tmp_path / "4096", tmp_path / "2048"], "h100")
    assert coefficients["compute_per_token_unnested_s"] == pytest.approx(UNNESTED, rel=1e-6)
    assert coefficients["compute_per_token_full_s"] == pytest.approx(FULL, rel=1e-6)
    assert coefficients["compute_per_token_fast_s"] == pytest.approx(FAST, rel=1e-6)
    assert coefficients["prefill_attention_per_key_s"] == pytest.approx(PER_KEY, rel=1e-6)
    assert "rms 0.00 ms" in lines[2]
    timeline = json.loads((tmp_path / "4096" / "dense-dps.json").read_text())["runs"][0]["timeline"]
    samples = [s for s in script.prefill_steps(tmp_path / "4096") if s.policy == "dps"]
    assert len(samples) == sum(point["step_tokens"] >= 1024 for point in timeline) < len(timeline)


def test_a_trace_workload_is_refused(tmp_path):
    synthetic_run(tmp_path / "run", "dps", 2048, kind="trace")
    with pytest.raises(SystemExit, match="fixed prompt length"):
        load_script().fit([tmp_path / "run"], "h100")


def test_the_packaged_h100_prefill_coefficients_come_from_the_recorded_runs(tmp_path):
    """Refitting sessions 44 and 46's recorded H100 runs and writing the result into a copy of the packaged H100 set
    leaves it as shipped: the JSON's prefill numbers are this script's output."""
    from importlib import resources

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "serving" / "results"
    packaged = (resources.files("elastiserve.control") / "data" / "step_model_h100_llama31_8b.json").read_text()
    copy = tmp_path / "h100.json"
    copy.write_text(packaged)
    script = load_script()
    runs = ["dense-one-gpu-s44/full-160", "dense-one-gpu-s44/half-scale-400", "dense-one-gpu-s46/full-conc56-600",
            "dense-one-gpu-s46/half-conc64-300"]
    coefficients, _ = script.fit([results / run for run in runs], "h100")
    script.write_coefficients(copy, coefficients)
    assert json.loads(copy.read_text()) == json.loads(packaged)
