"""``benchmarks/control/fit_kv_read.py`` on synthetic runs whose decode steps follow a known step model: the fit
recovers the intercept, KV-read coefficient, padding-row fraction, BASE read fraction, per-step BASE constant and
demotion cost it was built from, and skips the samples that are not one decode-only step (an admission, a
prefill-length step, two steps in one sample). The second test pins the bug the two-stage fit fixes: with the pool
full, TARGET + BASE / 2 is constant, so a per-step cost only elastickv pays went into the BASE coefficient when both
policies shared one intercept; and PROMOTING pairs (left out of kv_manager's ``base_pairs``) are BASE for
readers. The running count crosses graph sizes (30-37 sequences pad to 32 or 48, as the H200 runs did), and padding
rows cost a known fraction of the mean sequence's KV read, which the fit recovers; a line without that term misses
the jump at 33 sequences (the third test)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from elastiserve.control.step_model import load_step_model, padded_batch

pytestmark = [pytest.mark.cpu]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "control" / "fit_kv_read.py"
INTERCEPT, PER_TARGET, FRACTION, BASE_STEP, DEMOTE = 0.0057, 4e-8, 0.6, 0.003, 0.005
PADDED_ROW = 0.8  # a CUDA-graph padding row costs this fraction of the batch's mean KV read per sequence
TOTAL_BLOCKS = 9_536


def load_script():
    spec = importlib.util.spec_from_file_location("fit_kv_read", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def step_seconds(target_tokens: int, base_tokens: int, demoted_pairs: int, running: int) -> float:
    padding = 1 + PADDED_ROW * (padded_batch(running, 256) - running) / running
    seconds = INTERCEPT + PER_TARGET * (target_tokens + FRACTION * base_tokens) * padding
    seconds += BASE_STEP if base_tokens else 0.0
    if demoted_pairs:
        seconds += DEMOTE + load_step_model().demote_per_pair_s * demoted_pairs
    return seconds


def synthetic_run(path: Path, policy: str, with_base: bool, full_pool: bool = False, noise_s: float = 0.0,
                  running_from: int = 30) -> None:
    """400 timeline samples, the running count rising by one every 50 (30-37: graph batches 32 and 48);
    ``full_pool``: every block used, so TARGET + BASE / 2 stays constant."""
    rng = random.Random(policy)
    samples, t, demotions, promotions = [], 0.0, 0, 0
    for step in range(400):
        used = TOTAL_BLOCKS if full_pool else rng.randint(2_000, 9_000)
        base = rng.randint(100, used // 3) if with_base and step % 5 else 0
        promoting = 7 if with_base and (step // 40) % 2 else 0  # each: its packed block and two reserved fresh ones
        demoted = 16 if with_base and step % 7 == 0 else 0
        demotions += demoted
        target_tokens = (used - base - 3 * promoting) * 16
        running = running_from + step // 50
        seconds = step_seconds(target_tokens, (base + promoting) * 32, demoted, running) + rng.gauss(0.0, noise_s)
        admits = step % 50 == 0  # an admission (running changes): not a decode-only step
        t += seconds + (0.2 if admits else 0.0)
        samples.append({"t": t, "steps": step + 1 + (step >= 300), "running": running, "waiting": 5,
                        "total_blocks": TOTAL_BLOCKS, "free_blocks": TOTAL_BLOCKS - used, "base_pairs": base,
                        "promoting_pairs": promoting, "demotions": demotions, "promotions": promotions})
    path.mkdir(exist_ok=True)
    (path / f"dense-{policy}.json").write_text(json.dumps({"runs": [{"policy": policy, "timeline": samples}]}))


def test_fit_recovers_the_coefficients_it_was_built_from(tmp_path):
    synthetic_run(tmp_path / "run", "static-fp16", with_base=False)
    synthetic_run(tmp_path / "run", "elastickv", with_base=True)
    result = load_script().fit([tmp_path / "run"])
    assert result.intercept_s == pytest.approx(INTERCEPT, rel=1e-6)
    assert result.padded_row_kv_fraction == pytest.approx(PADDED_ROW, rel=1e-6)
    assert result.per_target_s == pytest.approx(PER_TARGET, rel=1e-6)
    assert result.base_read_fraction == pytest.approx(FRACTION, rel=1e-4)
    assert result.base_step_s == pytest.approx(BASE_STEP, rel=1e-4)
    assert result.demote_batch_s == pytest.approx(DEMOTE, rel=1e-3)
    assert result.target_rms_s < 1e-9 and result.base_rms_s < 1e-9  # the quiet steps follow the model exactly
    assert "392 static-fp16 decode steps" in result.lines[0]  # 400 samples less 8 admissions / double steps


def test_full_pool_per_step_cost_is_not_charged_to_base_tokens(tmp_path):
    """elastickv at a full pool (BASE share varying, the collinear case), TARGET line from a separate static-fp16 run,
    0.3 ms of step noise: the two-stage fit gets within a few per cent; the session-6 fit (both policies, one
    intercept, promoting pairs as TARGET blocks) would put the 3 ms step constant into the BASE fraction."""
    synthetic_run(tmp_path / "ref", "static-fp16", with_base=False, noise_s=3e-4)
    synthetic_run(tmp_path / "base", "elastickv", with_base=True, full_pool=True, noise_s=3e-4)
    result = load_script().fit([tmp_path / "base"], target_runs=[tmp_path / "ref"])
    assert result.per_target_s == pytest.approx(PER_TARGET, rel=0.02)
    assert result.padded_row_kv_fraction == pytest.approx(PADDED_ROW, abs=0.05)
    assert result.intercept_s == pytest.approx(INTERCEPT, abs=3e-4)
    assert result.base_read_fraction == pytest.approx(FRACTION, abs=0.05)
    assert result.base_step_s == pytest.approx(BASE_STEP, abs=4e-4)
    assert result.demote_batch_s == pytest.approx(DEMOTE, abs=3e-4)
    assert 2e-4 < result.base_rms_s < 4e-4  # the noise, nothing left unexplained
    # The session-6 way on the same steps: one intercept and line through both policies' quiet steps.
    module = load_script()
    steps = [s for run in ("ref", "base") for s in module.decode_steps(tmp_path / run)
             if not s.demoted_pairs and not s.promotion_event]
    x = np.array([[1.0, s.target_tokens, s.base_tokens] for s in steps])
    (_, per_target, per_base), *_ = np.linalg.lstsq(x, np.array([s.seconds for s in steps]), rcond=None)
    assert per_base / per_target > FRACTION + 0.3  # the step constant, charged to BASE tokens


def test_padding_to_a_larger_graph_is_not_charged_to_base(tmp_path):
    """elastickv at 34-41 sequences (padded to 48), the reference at 30-37 (32 and 48) with 0.3 ms of step noise:
    with the padding term the fit recovers the 3 ms BASE constant and leaves only the noise on the reference steps;
    a TARGET line without it (the first session-7 fit) misses the 32 -> 48 jump by more than the noise."""
    synthetic_run(tmp_path / "ref", "static-fp16", with_base=False, noise_s=3e-4)
    synthetic_run(tmp_path / "base", "elastickv", with_base=True, full_pool=True, noise_s=3e-4, running_from=34)
    module = load_script()
    result = module.fit([tmp_path / "base"], target_runs=[tmp_path / "ref"])
    assert result.base_step_s == pytest.approx(BASE_STEP, abs=4e-4)
    assert result.base_read_fraction == pytest.approx(FRACTION, abs=0.05)
    assert result.padded_row_kv_fraction == pytest.approx(PADDED_ROW, abs=0.05)
    assert 2e-4 < result.target_rms_s < 4e-4
    ref = list(module.decode_steps(tmp_path / "ref"))
    x = np.array([[1.0, s.target_tokens] for s in ref])
    y = np.array([s.seconds for s in ref])
    line, *_ = np.linalg.lstsq(x, y, rcond=None)
    assert np.sqrt(np.mean((x @ line - y) ** 2)) > 1.5 * result.target_rms_s  # 0.59 vs 0.32 ms here


def test_nested_weight_reads_take_host_overhead_from_their_own_decode_run(tmp_path):
    """The plain fp16 read is the serving intercept less the decode run's host overhead (its batch-1 step less its
    forward pass), not another device's figure; the nested reads differ from it by their steps' difference."""
    script = load_script()
    fit = script.KVReadFit(intercept_s=0.0066, padded_row_kv_fraction=0.4, per_target_s=4e-8, base_read_fraction=0.3,
                           base_step_s=0.003, target_rms_s=0.0, base_rms_s=0.0, demote_batch_s=None, lines=[])
    run = {"roofline": {"step_s": 0.0054, "forward_only_s": 0.0050, "context": 512},
           "fast_full": [{"batch": 1, "full_s": 0.0055, "fast_s": 0.0033}]}
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(run))
    reads = script.nested_weight_reads(path, fit)
    assert reads["host_s"] == pytest.approx(0.0004)
    assert reads["weight_read_unnested_s"] == pytest.approx(0.0062)
    assert reads["weight_read_full_s"] == pytest.approx(0.0063)
    assert reads["weight_read_fast_s"] == pytest.approx(0.0041)
    assert reads["direct_fast_s"] == pytest.approx(0.0033 - 0.0004 - 4e-8 * 513)
