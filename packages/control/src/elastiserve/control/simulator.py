"""Discrete-event simulator: replicas of ``Replica`` behind a router, driven by a request stream.

Each replica keeps its own clock and advances one scheduling step at a time; before a request is routed at its
arrival time, every replica is stepped up to that time, so a least-loaded router sees current queue lengths.
With ``SimConfig.max_concurrency`` the stream is closed-loop like a benchmark client's ``--max-concurrency``: a
request is sent at its arrival or, when that many are outstanding, as soon as one finishes (TTFT counts from the
send, as the client measures it).
The control plane, the pair/unit bookkeeping and the metrics are the real ones; only the GPU is a step-time model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from elastiserve.control.config import ControlConfig, preset
from elastiserve.control.metrics import (
    RequestRecord,
    RunSummary,
    capacity_from_sweep,
    eff_at,
    mean,
    percentile,
    slo_attainment,
)
from elastiserve.control.sim_replica import Replica, ReplicaConfig
from elastiserve.control.step_model import StepModel, load_step_model
from elastiserve.control.workloads import Request, clip_lengths, gamma_arrivals, with_arrivals
from elastiserve.platforms import ConfigError, ElastiserveError

ROUTERS = ("least-loaded", "round-robin")


class SimulationStalled(ElastiserveError, RuntimeError):
    """The simulation stopped making progress (a bug, or a request that can never fit)."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    replicas: int = 1
    router: str = "least-loaded"
    ttft_limit_s: float = 2.0
    tbt_factor: float = 5.0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError("replicas must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError("max_concurrency must be >= 1 (or None for an open-loop stream)")
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {ROUTERS}")

    @property
    def max_context(self) -> int:
        """Longest prompt + output one replica can always hold: half its FP16 KV budget (leaves room for others)."""
        return self.replica.native_blocks * self.replica.block_size // 2


@dataclass(slots=True)
class SimResult:
    name: str
    replicas: list[Replica]
    t_base: float
    sim: SimConfig

    @property
    def records(self) -> list[RequestRecord]:
        return [r for rep in self.replicas for r in rep.records]

    def summary(self) -> RunSummary:
        recs = self.records
        ttfts = [r.ttft for r in recs if r.token_times]
        base = sum(rep.exposure.base_pairs for rep in self.replicas)
        pairs = sum(rep.exposure.pairs for rep in self.replicas)
        total_time = sum(rep.modes.total for rep in self.replicas)
        fast_time = sum(rep.modes.any_fast for rep in self.replicas)
        layer_time = sum(rep.modes.layer_fast for rep in self.replicas)
        counts = [rep.events.amounts() for rep in self.replicas]
        transitions = sum(sum(rep.events.mode_transitions()) for rep in self.replicas)
        restores = [x for rep in self.replicas for x in rep.events.restore_latencies()]
        return RunSummary(
            name=self.name,
            requests=len(recs),
            finished=sum(r.finished for r in recs),
            attainment=slo_attainment(recs, self.t_base, self.sim.tbt_factor, self.sim.ttft_limit_s),
            eff300=eff_at(recs, 0.3),
            ttft_p50=percentile(ttfts, 50),
            ttft_p90=percentile(ttfts, 90),
            ttft_p99=percentile(ttfts, 99),
            ttft_mean=mean(ttfts),
            tpot_mean=mean([r.tpot for r in recs if len(r.token_times) > 1]),
            tail_tbt_p90=percentile([r.tail_tbt for r in recs], 90),
            preemptions=sum(c.get("preempt", 0) for c in counts),
            base_exposure=base / pairs if pairs else 0.0,
            fast_fraction=fast_time / total_time if total_time else 0.0,
            fp8_layer_fraction=layer_time / total_time if total_time else 0.0,
            transitions=transitions,
            demoted_pairs=sum(c.get("demote", 0) for c in counts),
            promoted_pairs=sum(c.get("promote_done", 0) for c in counts),
            restore_latency_mean=mean(restores),
            makespan=max(rep.now for rep in self.replicas),
        )


def _advance(rep: Replica, until: float, max_idle_steps: int = 1_000_000) -> None:
    """Step ``rep`` while its clock is before ``until``; an idle replica jumps to its next wake-up or ``until``."""
    idle = 0
    while rep.now < until:
        if not rep.busy:
            rep.now = until
            return
        if rep.run_step():
            idle = 0
            continue
        idle += 1
        wake = rep.next_wakeup()
        if wake is None and not math.isfinite(until):
            raise SimulationStalled(f"replica stuck at t={rep.now:.3f} with {rep.load()} requests")
        rep.now = min(until, wake) if wake is not None and wake > rep.now else until
        if idle > max_idle_steps:
            raise SimulationStalled(f"replica idle-looping at t={rep.now:.3f}")


def simulate(
    requests: list[Request],
    control: ControlConfig | str,
    sim: SimConfig | None = None,
    step_model: StepModel | None = None,
) -> SimResult:
    control = preset(control) if isinstance(control, str) else control
    sim = sim or SimConfig()
    sm = step_model or load_step_model()
    stream = sorted(clip_lengths(requests, sim.max_context // 2, sim.max_context // 2), key=lambda r: r.arrival)
    replicas = [Replica(sim.replica, control, sm) for _ in range(sim.replicas)]
    sent = 0.0  # closed loop: sends are in order, and a free slot found without waiting dates from the last send
    for i, req in enumerate(stream):
        if sim.max_concurrency is not None:
            sent = max(sent, _wait_for_slot(replicas, sim.max_concurrency))
            if sent > req.arrival:
                req = replace(req, arrival=sent)
        for rep in replicas:
            _advance(rep, req.arrival)
        if sim.router == "round-robin":
            target = replicas[i % len(replicas)]
        else:
            target = min(replicas, key=lambda r: (r.load(), replicas.index(r)))
        target.submit(req)
    for rep in replicas:
        _drain(rep)
    return SimResult(control.name, replicas, sm.base_tpot(), sim)


def _step_or_wait(rep: Replica) -> None:
    """One step of a busy replica, or a jump to its next transfer completion when nothing can run."""
    if rep.run_step():
        return
    wake = rep.next_wakeup()
    if wake is None and rep.busy:
        raise SimulationStalled(f"replica stuck at t={rep.now:.3f} with {rep.load()} requests")
    if wake is not None:
        rep.now = max(rep.now, wake)


def _wait_for_slot(replicas: list[Replica], limit: int) -> float:
    """Step the earliest busy replica until fewer than ``limit`` requests are outstanding; returns the send time."""
    now = 0.0
    while sum(rep.load() for rep in replicas) >= limit:
        rep = min((r for r in replicas if r.load()), key=lambda r: r.now)
        _step_or_wait(rep)
        now = rep.now
    return now


def _drain(rep: Replica) -> None:
    """Run until every request has finished and every transfer has landed."""
    while rep.busy:
        _step_or_wait(rep)


def capacity_sweep(
    lengths: list[tuple[int, int]],
    rates: list[float],
    control: ControlConfig | str,
    sim: SimConfig | None = None,
    cv: float = 2.0,
    seed: int = 0,
    threshold: float = 0.9,
) -> tuple[float, dict[float, float]]:
    """DPS capacity: replay ``lengths`` with Gamma(cv) arrivals at each rate; return (capacity, attainment by rate),
    capacity being the highest rate with attainment >= threshold at it and every lower swept rate."""
    attainment = {}
    for rate in sorted(rates):
        requests = with_arrivals(lengths, gamma_arrivals(len(lengths), rate, cv, seed))
        attainment[rate] = simulate(requests, control, sim).summary().attainment
    return capacity_from_sweep(attainment, threshold), attainment
