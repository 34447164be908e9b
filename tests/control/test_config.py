"""Pins the control configuration: paper defaults, validation by ConfigError, and what each preset enables."""

import pytest

from elastiserve.control.config import (
    PRESETS,
    ArbiterConfig,
    ControlConfig,
    KVFidelityConfig,
    PrecisionConfig,
    preset,
)
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def test_paper_defaults():
    kv = KVFidelityConfig()
    assert (kv.b_min, kv.reserve_decay, kv.demotion_trigger, kv.promotion) == (16, 2, "shortage", "reserve")


@pytest.mark.parametrize(
    "build",
    [
        lambda: KVFidelityConfig(b_min=0),
        lambda: KVFidelityConfig(reserve_decay=-1),
        lambda: KVFidelityConfig(demotion_trigger="sometimes"),
        lambda: KVFidelityConfig(promotion="lazy"),
        lambda: KVFidelityConfig(f_post="after-admission"),
        lambda: KVFidelityConfig(max_base_fraction=1.5),
        lambda: PrecisionConfig(kappa_low=0.9, kappa_high=0.8),
        lambda: PrecisionConfig(granularity="head"),
        lambda: ArbiterConfig(mechanisms=()),
        lambda: ArbiterConfig(mechanisms=("demote", "demote")),
        lambda: ArbiterConfig(mechanisms=("offload",)),
        lambda: ArbiterConfig(pressure_duration_s=0),
        lambda: ControlConfig(kv="fast"),
        lambda: preset("static-fp4"),
    ],
)
def test_invalid_configs_raise(build):
    with pytest.raises(ConfigError):
        build()


def test_presets_enable_the_right_mechanisms():
    enabled = {name: (preset(name).uses_demotion, preset(name).uses_eviction) for name in PRESETS}
    assert enabled == {
        "static-fp16": (False, False),
        "static-fp8": (False, True),
        "dps": (False, True),
        "elastickv": (True, False),
        "combined": (True, True),
    }
    assert preset("static-fp8").precision.static_fast
    assert preset("combined").precision.granularity == "layer"
    assert preset("dps").precision.granularity == "model"
    for name in PRESETS:
        assert "preempt" in preset(name).arbiter.mechanisms


def test_cost_model_is_per_block_at_expected_duration():
    a = ArbiterConfig(demote_quality_cost_per_block=1.0, evict_quality_cost_per_block=0.25, evict_latency_s=0.8,
                      demote_latency_s=0.5, latency_weight=2.0, preempt_cost_per_block=7.0)
    assert a.cost_per_block("demote", 3.0, 1) == 1.0 * 3.0 + 2.0 * 0.5
    assert a.cost_per_block("evict", 3.0, 4) == 0.25 * 3.0 + 2.0 * 0.8 / 4
    assert a.cost_per_block("preempt", 3.0, 1) == 7.0
