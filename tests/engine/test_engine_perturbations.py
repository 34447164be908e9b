"""Randomized engine runs (hypothesis draws the scenario) on the tiny Llama: requests arrive at random steps, some
are aborted, running ones are preempted (a small KV pool, and the control's ``Decision(preempt=...)``), n-choice
twins wait for their leader, prefix caching is on or off, and with elastickv random pairs are demoted and promoted.

Checked after every step: the pool's allocated blocks are exactly those live sequences hold (one sequence each, or
several through a shared cached pair) and those promotions in flight reserve; retained cache blocks count as free.
Checked at the end: every request not aborted finished with exactly its ``max_tokens`` valid tokens, an abort
succeeds only before the finish, nothing is output after either; the pool, the host slots and the transfers are all
back (the prefix cache keeps only unused pairs); every promoted pair is bit-exact with its bytes before demotion.
Greedy tokens equal the request's run alone, up to the first transition that changes numerics: the CPU engine is not
bitwise batch-invariant (chunked prefill changes the attention's reductions; an fp16 ulp or two in the logits), so
each token's logprob must be close to the lone run's, and a token may differ only where the lone run's top two were
a near tie (the rest is then another context). dps is costly on the CPU (the nested GEMMs run interpreted), so it
gets one scripted run: preemptions before a full -> fast -> full switch, KV spilling into the evicted residual
units, and a bit-exact restore of the weights. Scenarios mix FCFS and priority scheduling; the hang they found there
(a choice served before its prefix leader was held for it) is pinned by
``test_a_choice_served_before_its_leader_is_not_held_for_it``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_policies import EvictThenRestore, snapshot_pairs
from test_engine_e2e import (  # noqa: F401  (tiny_llama: a fixture)
    block_bytes,
    block_size_for,
    make_engine,
    nested_linears,
    step_until_full_precision,
    tiny_llama,
)

from elastiserve.control.observation import NOOP
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.sequence import PairState

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

VOCAB = 211
LOGPROB_TOL = 0.03  # a token's logprob against the lone run's (observed: <= 0.004)
NEAR_TIE = 0.03  # the lone run's top-two gap under which a perturbed run may pick the runner-up
SEEDED_PREFIXES = [[(37 * i + 11 * k) % VOCAB for i in range(4 * 32)] for k in range(3)]  # 4 pairs of 16-blocks


@dataclass(frozen=True)
class Request:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrive: int  # added before the step that would be the engine's ``arrive + 1``-th
    abort: int | None = None  # aborted before that step, when not None
    leader: str | None = None  # an n-choices twin: same prompt, same arrival
    priority: int = 0


class Perturbations:
    """Scripted control: at given steps preempt blocks and demote pairs (pressure), promote pairs (recovery), then
    promote every BASE pair after the last scripted demotion or promotion; ``inner``'s own decisions (a mode switch)
    come along."""

    def __init__(self, preempt=None, demote=None, promote=None, inner=None) -> None:
        self.preempt, self.demote, self.promote = preempt or {}, demote or {}, promote or {}
        self.inner = inner
        self.last = max([0, *self.demote, *self.promote])

    def decide_pressure(self, obs):
        base = self.inner.decide_pressure(obs) if self.inner else NOOP
        return replace(base, preempt=self.preempt.get(obs.step, 0),
                       demote_pairs=min(self.demote.get(obs.step, 0), obs.target_pairs_eligible))

    def decide_recovery(self, obs):
        base = self.inner.decide_recovery(obs) if self.inner else NOOP
        wanted = self.promote.get(obs.step, 0) if obs.step <= self.last else obs.base_pairs_promotable
        return replace(base, promote_pairs=min(wanted, obs.base_pairs_promotable))


def check_books(engine) -> None:
    """The pool's allocated blocks are those live sequences hold and promotions reserve; only a cached pair's blocks
    are held twice."""
    kv = engine.kv
    live = [*engine.scheduler.running, *engine.scheduler.waiting]
    owners = Counter(b for s in live for b in set(s.block_table))  # a BASE pair lists its packed block twice
    shared = {b for s in live for p, held in enumerate(s.cache_held) if held for b in s.block_table[2 * p : 2 * p + 2]}
    assert all(n == 1 or b in shared for b, n in owners.items()), owners
    reserved = {b for op in kv.promotions_in_flight() for b in (op.dst_a, op.dst_b)}
    assert not reserved & owners.keys()
    assert kv.pool.num_allocated() == len(owners) + len(reserved)  # retained cache blocks count as free


def check_all_returned(engine, usable: int) -> None:
    assert not engine.has_unfinished() and not engine.kv.promotions_in_flight()
    engine.step()  # idle: drains the runner's finished transfers, as a serving loop's next step would
    counts = engine.stats()
    assert counts["free_blocks"] == usable and counts["base_pairs"] == counts["promoting_pairs"] == 0
    assert counts["free_host_slots"] == engine.kv.num_host_slots and engine.runner.transfers_in_flight() == 0
    cache = engine.kv.prefix_cache
    if cache is not None:  # only pairs nobody uses are left, all retained
        assert cache.num_retained_blocks == 2 * len(cache)


def reference_run(engine, prompt, max_tokens) -> list[tuple[int, float, tuple]]:
    """(token, logprob, top two) of each step of ``prompt`` run alone on an idle static-fp16 engine."""
    engine.add_request("ref", list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                           logprobs=2))
    outs = []
    while engine.has_unfinished():
        outs += [(o.new_token_ids[0], o.logprobs[0].logprob, o.logprobs[0].top) for o in engine.step()]
    return outs


@pytest.fixture(scope="module")
def alone(tiny_llama, device):  # noqa: F811
    engine, memo = make_engine(tiny_llama, device), {}

    def run(prompt: tuple[int, ...], max_tokens: int):
        if len(memo.get(prompt, ())) < max_tokens:
            memo[prompt] = reference_run(engine, prompt, max_tokens)
        return memo[prompt][:max_tokens]

    return run


def assert_like_alone(rid: str, got: list[tuple[int, int, float]], ref, until_step: float) -> int:
    """``got``: (step, token, logprob) outputs; those of steps before ``until_step`` follow the lone run. Returns how
    many tokens were compared."""
    for i, ((step, token, logprob), (ref_token, ref_logprob, top)) in enumerate(zip(got, ref)):
        if step >= until_step:
            return i
        if token != ref_token:  # only a near tie may flip; the contexts differ from here on
            gap = top[0][1] - top[1][1]
            assert token == top[1][0] and gap < NEAR_TIE, f"{rid} token {i}: {token}, alone {ref_token} (gap {gap})"
            return i
        assert abs(logprob - ref_logprob) < LOGPROB_TOL, f"{rid} token {i}: logprob {logprob} alone {ref_logprob}"
    return len(got)


def was_demoted(seq, preemptions: int, pair: int) -> bool:
    """Whether ``pair`` left TARGET in the step that may have demoted it (and its sequence kept its KV)."""
    kept = not seq.is_finished and seq.metrics.preemptions == preemptions
    return kept and seq.pair_states[pair] is not PairState.TARGET


def drive(engine, requests: list[Request], snapshot_at=frozenset(), on_step=None):
    """Add, abort and step until everything is done, checking the books after every step and each pair promoted
    back against its bytes before the scripted step (``snapshot_at``) that demoted it; returns each request's
    (step, token, logprob) outputs and the ids aborted in flight."""
    outputs: dict[str, list] = {r.rid: [] for r in requests}
    finished, aborted, before = set(), set(), {}
    last_arrival = max(r.arrive for r in requests)
    while engine.step_count <= last_arrival or engine.has_unfinished():
        step = engine.step_count
        for r in requests:
            if r.arrive == step:
                params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, logprobs=2)
                engine.add_request(r.rid, list(r.prompt), params, prefix_leader=r.leader, priority=r.priority)
            if r.abort == step and r.abort >= r.arrive:
                assert engine.abort_request(r.rid) == (r.rid not in finished | aborted)
                aborted |= {r.rid} - finished
        snapshot = {}  # the pairs a demotion may take this step, as they are now
        for seq in engine.scheduler.running if step + 1 in snapshot_at else ():
            for pair, blocks in snapshot_pairs(engine, seq.request_id).items():
                snapshot[(seq.request_id, pair)] = (seq, seq.metrics.preemptions, blocks)
        for out in engine.step():
            assert out.request_id not in finished | aborted and len(out.new_token_ids) == 1
            outputs[out.request_id].append((engine.step_count, out.new_token_ids[0], out.logprobs[0].logprob))
            if out.finished:
                assert out.finish_reason == "length" and out.num_output_tokens == len(outputs[out.request_id])
                finished.add(out.request_id)
        check_books(engine)
        if on_step is not None:
            on_step(engine)
        before |= {key: v for key, v in snapshot.items() if was_demoted(v[0], v[1], key[1])}
        for key, (seq, preemptions, blocks) in list(before.items()):
            if seq.is_finished or seq.metrics.preemptions != preemptions:  # its KV is gone
                del before[key]
            elif seq.pair_states[key[1]] is PairState.TARGET:  # promoted
                kv, table = engine.runner.kv_cache, seq.block_table
                assert all(torch.equal(kv[table[2 * key[1] + i]], blocks[i]) for i in (0, 1)), key
                del before[key]
        assert engine.step_count < 500, "the engine stopped making progress"
    by_id = {r.rid: r for r in requests}
    for rid, got in outputs.items():
        assert all(0 <= token < VOCAB for _, token, _ in got)
        assert len(got) == by_id[rid].max_tokens if rid not in aborted else len(got) < by_id[rid].max_tokens
    return outputs, aborted


drawn_request = st.tuples(
    st.integers(0, 2), st.integers(0, 3),  # a shared prefix and how many of its pairs the prompt starts with
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),  # the rest of the prompt
    st.integers(1, 16), st.integers(0, 8), st.none() | st.integers(0, 10),  # max_tokens, arrival, abort delay
    st.booleans(), st.integers(0, 2),  # an n-choices twin of the request before it; priority
)
scenarios = st.fixed_dictionaries({
    "requests": st.lists(drawn_request, min_size=1, max_size=8),
    "prefix_caching": st.booleans(),
    "by_priority": st.booleans(),  # scheduling_policy="priority", else FCFS (and every priority 0)
    "small_pool": st.booleans(),  # 16 blocks (CPU): requests preempt each other
    "max_num_seqs": st.integers(1, 4),
    "budget": st.sampled_from([8, 16, 64]),
    "preempt": st.dictionaries(st.integers(1, 24), st.integers(1, 8), max_size=3),  # step -> blocks
})
demotions = st.dictionaries(st.integers(2, 12), st.integers(1, 8), min_size=1, max_size=6)  # step -> pairs
promotions = st.dictionaries(st.integers(2, 12), st.integers(1, 8), max_size=4)  # then all, after the last move
FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def build(tiny_llama, device, scenario, policy: str, control, **overrides):  # noqa: F811
    block = block_size_for(device)
    requests: list[Request] = []
    for i, (prefix, pairs, rest, max_tokens, arrive, abort, twin, priority) in enumerate(scenario["requests"]):
        prompt, leader = (*SEEDED_PREFIXES[prefix][: pairs * 2 * block], *rest), None
        abort = None if abort is None else arrive + abort
        if twin and requests:
            prompt, arrive, leader = requests[-1].prompt, requests[-1].arrive, requests[-1].rid
        priority = priority if scenario["by_priority"] else 0
        requests.append(Request(f"r{i}", prompt, max_tokens, arrive, abort, leader, priority))
    pool = 16 if scenario["small_pool"] else 96
    engine = make_engine(tiny_llama, device, scripted=control, policy=policy, kv_cache_budget=pool * block_bytes(block),
                         enable_prefix_caching=scenario["prefix_caching"], max_num_seqs=scenario["max_num_seqs"],
                         scheduling_policy="priority" if scenario["by_priority"] else "fcfs",
                         max_num_batched_tokens=scenario["budget"], **overrides)  # fmt: skip
    return engine, requests


def first_event(engine, kind: str) -> float:
    return min((e.step for e in engine.events.events if e.kind == kind), default=float("inf"))


@FUZZ
@given(scenario=scenarios)
def test_static_fp16_perturbations_keep_the_lone_greedy_tokens(tiny_llama, device, alone, scenario):  # noqa: F811
    engine, requests = build(tiny_llama, device, scenario, "static-fp16", Perturbations(scenario["preempt"]))
    usable = engine.kv.pool.num_free(False)
    outputs, _ = drive(engine, requests)
    for r in requests:
        assert_like_alone(r.rid, outputs[r.rid], alone(r.prompt, r.max_tokens), float("inf"))
    check_all_returned(engine, usable)


@FUZZ
@given(scenario=scenarios, demote=demotions, promote=promotions, protect=st.integers(0, 1))
def test_elastickv_demotion_and_promotion_lose_nothing(tiny_llama, device, alone, scenario, demote, promote,  # noqa: F811
                                                       protect):
    control = Perturbations(scenario["preempt"], demote, promote)  # protect: sink and recent pairs never demoted
    engine, requests = build(tiny_llama, device, scenario, "elastickv", control, sink_pairs=protect,
                             recent_pairs=protect)
    usable = engine.kv.pool.num_free(False)
    outputs, _ = drive(engine, requests, snapshot_at=frozenset(demote))
    exact_until = first_event(engine, "demote")
    for r in requests:
        assert_like_alone(r.rid, outputs[r.rid], alone(r.prompt, r.max_tokens), exact_until)
    check_all_returned(engine, usable)


def test_dps_switch_mid_flight_restores_weights_and_loses_nothing(tiny_llama, device, alone):  # noqa: F811
    """dps under scripted control: in full mode a preemption (the control's) and an abort; every residual evicted
    at step 5 with requests in flight and two long ones arriving, whose KV spills into the evicted units; restores
    asked from step 6. Tokens before the switch follow the lone runs, the restored weights are bit-exact (the spill
    overwrote their lower planes' units), nothing leaks."""
    from elastiserve.kernels import formats

    block = block_size_for(device)
    pair, long, (p0, p1, p2) = 2 * block, min(20 * block, 100), SEEDED_PREFIXES
    requests = [Request("a", tuple(p0[: 2 * pair + 3]), 8, 0), Request("b", tuple(p1[: pair + 5]), 7, 0),
                Request("c", tuple(p0[: 2 * pair + 1]), 6, 1, abort=3), Request("d", tuple(p2[:long]), 3, 4),
                Request("e", tuple(p1[: long - 5]), 2, 4)]  # fmt: skip
    control = Perturbations(preempt={2: 2}, inner=EvictThenRestore(evict_at=5, restore_from=6))
    engine = make_engine(tiny_llama, device, scripted=control, policy="dps", kv_cache_budget=block_bytes(block),
                         max_num_batched_tokens=64)  # fmt: skip
    usable = engine.kv.pool.num_free(False)  # one unit: the residuals' units are not KV's
    linears = nested_linears(engine.model)
    weights = {name: formats.merge(m.upper, m.lower, m.nesting, m.weight_exp) for name, m in linears.items()}
    lower = {name: m.lower.clone() for name, m in linears.items()}
    used = []
    outputs, aborted = drive(engine, requests, on_step=lambda e: used.append(e.kv.pool.num_allocated()))
    assert aborted == {"c"} and engine.stats()["preemptions"] == 1 and first_event(engine, "mode_fast") == 5
    assert max(used) > usable or device.type == "cuda"  # KV spilled into the evicted residual units (CPU pool)
    # Tokens before the switch: 10 with the CPU's 4-token blocks, 4 with a GPU's 16-token ones (prompts of whole
    # pairs take more prefill chunks; all 4 followed the lone runs on an H100, session 42). A near tie may cut one
    # request's comparison short, no more.
    before_switch = {r.rid: sum(step < 5 for step, _, _ in outputs[r.rid]) for r in requests}
    cut_short = [r.rid for r in requests
                 if assert_like_alone(r.rid, outputs[r.rid], alone(r.prompt, r.max_tokens), 5) < before_switch[r.rid]]
    expected = 10 if device.type == "cpu" else 4  # the schedule's, whatever the numerics
    assert sum(before_switch.values()) == expected and len(cut_short) <= 1, (before_switch, cut_short)
    step_until_full_precision(engine)
    for name, m in linears.items():
        assert torch.equal(m.lower, lower[name]), name
        assert torch.equal(formats.merge(m.upper, m.lower, m.nesting, m.weight_exp), weights[name]), name
    check_all_returned(engine, usable)


def test_a_choice_served_before_its_leader_is_not_held_for_it(tiny_llama, device):  # noqa: F811
    """Regression (found by the fuzz test above): under priority scheduling a choice of a higher priority than its
    prefix leader was queued ahead of the leader and held for it, and the queue stopped there for good. Such a
    choice now ignores the leader (it computes its own prompt); one of the leader's priority still waits for it."""
    engine = make_engine(tiny_llama, device, enable_prefix_caching=True, scheduling_policy="priority")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = list(range(3 * block_size_for(device)))
    engine.add_request("leader", prompt, params, priority=1)
    engine.add_request("first", prompt, params, prefix_leader="leader", priority=0)
    engine.add_request("twin", prompt, params, prefix_leader="leader", priority=1)
    assert engine.scheduler.find("first").prefix_leader is None
    assert engine.scheduler.find("twin").prefix_leader == "leader"
    for _ in range(20):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
