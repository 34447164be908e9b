"""elastiserve control plane: plain Python (never imports torch).

Policies (ElasticKV Algorithm 1 in ``kv_fidelity``, DPS precision switching in ``precision``), one cost-model
``Arbiter`` over demotion / residual eviction / preemption, events, metrics, workloads and a discrete-event
simulator that drives them.
"""

from elastiserve.control.arbiter import Arbiter
from elastiserve.control.config import (
    PRESETS,
    ArbiterConfig,
    ControlConfig,
    KVFidelityConfig,
    PrecisionConfig,
    preset,
)
from elastiserve.control.events import EVENT_KINDS, Event, EventLog
from elastiserve.control.kv_fidelity import KVFidelityPolicy, capacity_guard
from elastiserve.control.observation import ALL_LAYERS, Decision, PairInfo, StepObservation, rank_demotable
from elastiserve.control.precision import PrecisionPolicy

__all__ = [
    "ALL_LAYERS",
    "EVENT_KINDS",
    "PRESETS",
    "Arbiter",
    "ArbiterConfig",
    "ControlConfig",
    "Decision",
    "Event",
    "EventLog",
    "KVFidelityConfig",
    "KVFidelityPolicy",
    "PairInfo",
    "PrecisionConfig",
    "PrecisionPolicy",
    "StepObservation",
    "capacity_guard",
    "preset",
    "rank_demotable",
]
__version__ = "0.1.0"
