"""Pins the workload loaders: the bundled Azure window parses to the trace's own offsets, the shared traces (CI has
../shared/traces beside the checkout) load with windowing and time scaling, Gamma arrivals have the asked rate and
CV and are deterministic per seed."""

import itertools
import math
import statistics

import pytest

from elastiserve.control.workloads import (
    bundled_azure_window,
    find_trace,
    gamma_arrivals,
    load_azure,
    load_trace,
    synthetic,
)
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def test_bundled_azure_window():
    reqs = load_azure(bundled_azure_window())
    assert len(reqs) == 2000
    assert (reqs[0].arrival, reqs[0].prompt_tokens, reqs[0].output_tokens) == (0.0, 374, 44)
    # Second row: 18:15:50.9951690 - 18:15:46.6805900 = 4.314579 s (microsecond resolution).
    assert reqs[1].arrival == pytest.approx(4.314579, abs=1e-6)
    assert reqs[-1].arrival == pytest.approx(424.26, abs=0.01)
    window = load_trace("azure-window", 10, 5, time_scale=0.5)
    assert len(window) == 5 and window[0].arrival == 0.0
    assert window[1].arrival == pytest.approx(0.5 * (reqs[11].arrival - reqs[10].arrival))


def test_shared_traces_load():
    mooncake = load_trace("mooncake", 0, 50)
    assert len(mooncake) == 50 and mooncake[0].arrival == 0.0
    assert (mooncake[0].prompt_tokens, mooncake[0].output_tokens) == (6758, 500)
    azure = load_trace("azure", 0, 3000)
    assert len(azure) == 3000  # the full trace, not the bundled window
    assert find_trace("sharegpt").name.startswith("sharegpt_8k")
    share = load_trace("sharegpt", 0, 100, rate=4.0, cv=2.0, seed=3)
    assert (share[0].prompt_tokens, share[0].output_tokens) == (74, 918)
    with pytest.raises(ConfigError):
        load_trace("arxiv", 0, 10)  # length tables need a rate


def test_gamma_arrivals_rate_cv_and_determinism():
    a = gamma_arrivals(20000, rate=5.0, cv=2.0, seed=7)
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, rel=0.1)
    assert a == gamma_arrivals(20000, rate=5.0, cv=2.0, seed=7)
    assert a != gamma_arrivals(20000, rate=5.0, cv=2.0, seed=8)
    s = synthetic(10, 100, 20, rate=2.0, cv=1.0, seed=0)
    assert all((r.prompt_tokens, r.output_tokens) == (100, 20) for r in s) and math.isclose(s[0].arrival, 0.0)
