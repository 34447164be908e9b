"""``benchmarks/control/fit_kv_read.py`` on a synthetic run whose decode steps follow the step model exactly: the fit
recovers the KV-read coefficient, the BASE read fraction and the demotion cost it was built from, and skips the
samples that are not one decode-only step (an admission, a prefill-length step, two steps in one sample)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from elastiserve.control.step_model import load_step_model

pytestmark = [pytest.mark.cpu]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "control" / "fit_kv_read.py"
PER_TARGET, FRACTION, DEMOTE = 4e-8, 1.3, 0.005


def load_script():
    spec = importlib.util.spec_from_file_location("fit_kv_read", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def synthetic_run(path: Path, policy: str, with_base: bool) -> None:
    model = load_step_model()
    intercept = model.host_overhead_s + model.weight_read_unnested_s
    rng = random.Random(policy)
    samples, t, demotions = [], 0.0, 0
    for step in range(400):
        used = rng.randint(2_000, 9_000)
        base_pairs = rng.randint(0, used // 3) if with_base else 0
        demoted = with_base and step % 7 == 0
        demotions += 16 if demoted else 0
        seconds = intercept + PER_TARGET * ((used - base_pairs) * 16 + FRACTION * base_pairs * 32)
        seconds += DEMOTE if demoted else 0.0
        admits = step % 50 == 0  # an admission (running changes): not a decode-only step
        t += seconds + (0.2 if admits else 0.0)
        samples.append({"t": t, "steps": step + 1 + (step >= 300), "running": 30 + (step // 50), "waiting": 5,
                        "total_blocks": 9_536, "free_blocks": 9_536 - used, "base_pairs": base_pairs,
                        "demotions": demotions})
    path.mkdir(exist_ok=True)
    (path / f"dense-{policy}.json").write_text(json.dumps({"runs": [{"policy": policy, "timeline": samples}]}))


def test_fit_recovers_the_coefficients_it_was_built_from(tmp_path):
    synthetic_run(tmp_path / "run", "static-fp16", with_base=False)
    synthetic_run(tmp_path / "run", "elastickv", with_base=True)
    result = load_script().fit([tmp_path / "run"])
    assert result.per_target_s == pytest.approx(PER_TARGET, rel=1e-6)
    assert result.base_read_fraction == pytest.approx(FRACTION, rel=1e-4)
    assert result.demote_batch_s == pytest.approx(DEMOTE, rel=1e-3)
    assert result.rms_s < 1e-9  # the steps that did not demote follow the two coefficients exactly
    assert result.lines[0].startswith("784 decode steps")  # 2 x 400 samples, less 2 x 8 admissions / double steps
