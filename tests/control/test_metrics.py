"""Pins the serving metrics against hand-computed values: TTFT, TPOT, TBT (max and mean of the slowest 10 %), the
DPS joint SLO, Eff@300, capacity from a sweep, percentiles, BASE exposure and mode time; and the event summaries."""

import math

import pytest

from elastiserve.control.events import Event, EventLog
from elastiserve.control.metrics import (
    ExposureMeter,
    ModeMeter,
    RequestRecord,
    capacity_from_sweep,
    eff_at,
    format_table,
    meets_joint_slo,
    percentile,
    slo_attainment,
)
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def rec(arrival, times, finish=True):
    return RequestRecord(0, arrival, 10, len(times), list(times), times[-1] if finish and times else None)


def test_request_latencies_by_hand():
    r = rec(1.0, [1.5, 1.6, 1.9, 2.0, 2.05])
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx((2.05 - 1.5) / 4)
    assert r.gaps == pytest.approx([0.1, 0.3, 0.1, 0.05])
    assert r.max_tbt == pytest.approx(0.3)
    assert r.tail_tbt == pytest.approx(0.3)  # k = max(1, ceil(0.4)) = 1
    gaps = [0.01 * i for i in range(1, 22)]  # 21 gaps -> k = ceil(2.1) = 3: mean of 0.21, 0.20, 0.19
    times = [0.0]
    for g in gaps:
        times.append(times[-1] + g)
    assert rec(0.0, times).tail_tbt == pytest.approx(0.20)
    single = rec(0.0, [0.3])
    assert (single.tpot, single.max_tbt, single.tail_tbt) == (0.0, 0.0, 0.0)
    assert RequestRecord(1, 0.0, 5, 5).ttft == math.inf


def test_joint_slo_and_attainment():
    t_base = 0.01  # max TBT must be <= 0.05, TTFT <= 2 s
    ok = rec(0.0, [1.9, 1.94, 1.98])
    slow_tbt = rec(0.0, [0.5, 0.56])
    slow_ttft = rec(0.0, [2.01, 2.02])
    unfinished = rec(0.0, [0.1, 0.11], finish=False)
    assert meets_joint_slo(ok, t_base)
    assert not meets_joint_slo(slow_tbt, t_base)
    assert not meets_joint_slo(slow_ttft, t_base)
    assert not meets_joint_slo(unfinished, t_base)
    assert slo_attainment([ok, slow_tbt, slow_ttft, unfinished], t_base) == 0.25
    assert math.isnan(slo_attainment([], t_base))


def test_eff300_is_strict():
    fast = rec(0.0, [29.0, 29.1])
    tbt_at_limit = rec(0.0, [1.0, 1.3])  # tail TBT == 0.3 is not < 0.3
    late = rec(0.0, [30.0, 30.1])
    assert eff_at([fast, tbt_at_limit, late], 0.3) == pytest.approx(1 / 3)


def test_capacity_from_sweep():
    assert capacity_from_sweep({0.5: 1.0, 1.0: 0.95, 1.5: 0.9, 2.0: 0.7, 2.5: 0.92}) == 1.5
    assert capacity_from_sweep({1.0: 0.5}) == 0.0


def test_percentile_linear():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))
    with pytest.raises(ConfigError):
        percentile([1], 101)


def test_exposure_and_mode_meters():
    m = ExposureMeter()
    m.add(1.0, 0, 10)
    m.add(3.0, 5, 10)
    assert m.exposure == pytest.approx(5 / 20)
    assert m.time_weighted == pytest.approx((0 + 3 * 0.5) / 4)
    with pytest.raises(ConfigError):
        m.add(1.0, 3, 2)
    modes = ModeMeter(num_layers=4)
    modes.add(1.0, 0)
    modes.add(2.0, 4)
    modes.add(1.0, 1)
    assert modes.fast_fraction == pytest.approx(3 / 4)
    assert modes.fp8_layer_fraction == pytest.approx((2 + 0.25) / 4)


def test_event_log_summaries():
    log = EventLog()
    log.add(1.0, 10, "mode_fast")
    log.add(1.0, 10, "evict_residual", 32)
    log.add(4.0, 40, "restore_start")
    log.add(4.5, 45, "restore_done")
    log.add(4.5, 45, "mode_full")
    log.add(6.0, 60, "mode_fast")
    log.add(6.0, 60, "demote", 16)
    log.add(6.5, 61, "demote", 16)
    assert log.mode_transitions() == (2, 1)
    assert log.time_in_modes(0.0, 10.0) == {"full": pytest.approx(1.0 + 1.5), "fast": pytest.approx(3.5 + 4.0)}
    assert log.restore_latencies() == [pytest.approx(0.5)]
    assert log.amounts()["demote"] == 32 and log.counts()["demote"] == 2
    with pytest.raises(ConfigError):
        Event(0.0, 0, "teleport")
    with pytest.raises(ConfigError):
        log.add(7.0, 70, "teleport")  # refused before it is counted
    from collections import Counter

    assert log.counts() == dict(Counter(e.kind for e in log.events)) and len(log) == 8


def test_table_format():
    text = format_table([{"a": "1", "bb": "22"}, {"a": "333", "bb": "4"}])
    assert text.splitlines() == ["  a  bb", "  1  22", "333   4"]
