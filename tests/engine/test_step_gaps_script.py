"""``benchmarks/serving/step_gaps.py``: host time between steps from a bench timeline (``t`` after each step less
its ``step_s``), and its medians by running sequences over decode-only steps that demoted nothing, against
hand-computed values."""

from __future__ import annotations

import gzip
import json

import pytest
from engine_scripts import load_serving_script

pytestmark = [pytest.mark.cpu]


def load_script():
    return load_serving_script("step_gaps")


def sample(t: float, steps: int, step_s: float, running: int, tokens: int, demotions: int = 0) -> dict:
    return {"t": t, "steps": steps, "step_s": step_s, "running": running, "step_seqs": running,
            "step_tokens": tokens, "demotions": demotions, "gc_s": 0.0}


TIMELINE = [
    sample(1.000, 1, 0.010, 4, 4),
    sample(1.012, 2, 0.010, 4, 4),  # host 2 ms, 4 running
    sample(1.025, 3, 0.010, 5, 12),  # host 3 ms, but a step with a prefill chunk (12 tokens, 5 sequences): out
    sample(1.039, 4, 0.010, 9, 9, demotions=3),  # host 4 ms, demoted: out
    sample(1.050, 5, 0.010, 9, 9, demotions=3),  # host 1 ms, 9 running
    sample(1.050, 5, 0.010, 9, 9, demotions=3),  # the same step sampled twice: no gap
    sample(1.0655, 6, 0.010, 10, 10, demotions=3),  # host 5.5 ms, 10 running
]


def test_gaps_and_medians_by_running_count():
    module = load_script()
    rows = module.step_gaps(TIMELINE)
    assert [round(r["host_s"] * 1e3, 6) for r in rows] == [2.0, 3.0, 4.0, 1.0, 5.5]
    assert [r["demoted"] for r in rows] == [0, 0, 3, 0, 0]
    medians = module.host_by_running(rows, 8)
    assert [(low, n) for low, n, _ in medians] == [(0, 1), (8, 2)]
    assert medians[0][2] == pytest.approx(2.0) and medians[1][2] == pytest.approx(3.25)


def test_cli_prints_the_buckets(tmp_path, capsys):
    path = tmp_path / "dense-elastickv.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"runs": [{"policy": "elastickv", "concurrency": 10, "timeline": TIMELINE, "summary": {}}]}, f)
    load_script().main([str(path), "--top", "1", "--by-running", "8"])
    out = capsys.readouterr().out
    assert "running 0-7: 1 decode steps, host median 2.00 ms" in out
    assert "running 8-15: 2 decode steps, host median 3.25 ms" in out
