"""A hypothesis state machine drives the KV manager through the call sequences the engine makes, with the engine's own
``Scheduler`` (admission with prefix matching, chunked prefill, preemption, finish, abort) and ``Transitions``
(ranked demotions, promotions, publication once their copies are done, failures to start) over a fake runner, on a
flat or an Algorithm 1 pool, with and without prefix caching. A step is: publish promotions -> pressure (demote,
preempt) -> schedule -> recovery (promote, cache retention) -> execute (exposure, registration, sampled tokens,
finishes); requests are added and aborted between steps.

After every operation (each rule and each phase of a step) it checks the books: every physical block is free or has
exactly one owner (a sequence's pair, a prefix-cache entry shared by reference count, a promotion's reservation); a
BASE or PROMOTING pair lists one packed block twice and holds a host slot; a PROMOTING pair's reserved blocks are its
own and its op is in flight; slots in use plus free slots are every slot; free + allocated is the pool; BASE run bounds
and demotable pairs (never sinks, recent or shared pairs) match a walk over the pairs; exposure counters are sane.
Aborting everything gives every block and slot back (what the cache retains counts as free), and evicting the cache
then leaves the inner pool full."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from elastiserve.control.events import EventLog
from elastiserve.engine.errors import DemotionFailed, PromotionFailed
from elastiserve.engine.kv_manager import FlatBlockPool, KVManager, SumBlockPool
from elastiserve.engine.prefix_cache import PrefixCache
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import Scheduler
from elastiserve.engine.sequence import PairState, Sequence, SequenceMetrics
from elastiserve.engine.transitions import Transitions
from elastiserve.memory.sum_state import SumState

pytestmark = [pytest.mark.cpu]

BS = 2  # pairs of 4 tokens: short prompts already have several pairs
PREFIXES = ((), (1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 5, 6, 0, 0), (3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3))
FAIL_AT = st.sampled_from([None, None, None, 0, 1, 2])  # the first op whose transfer fails to start (None: none)
RARELY = st.sampled_from([False] * 9 + [True])
# the control plane's answers: (demote pairs, fail_at, preempt blocks) and (promote pairs, fail_at, cache retention)
PRESSURE = st.tuples(st.integers(0, 4), FAIL_AT, st.sampled_from([0] * 6 + [1, 2, 4]))
RECOVERY = st.tuples(st.integers(0, 4), FAIL_AT, st.sampled_from([None] * 4 + [False, True]))


class FakeRunner:
    """The runner's side of pair transitions: ops from ``fail_at`` on fail to start; a poll finds the first
    ``completing`` promotions done, in the order they started (one stream, as on a GPU; all of them when None, as on
    the CPU). A promotion abandoned with its sequence stays in flight until its copy is done, as it does there, so
    polls return ops of aborted and preempted sequences, some of them running again (a probe of one run: 149 of 452
    polled ops, 32 with their sequence back). A stale op equal to its sequence's new one, field for field, is too rare
    to meet here: ``test_kv_manager.py`` builds it."""

    def __init__(self) -> None:
        self.in_flight: list = []
        self.fail_at: int | None = None
        self.completing: int | None = None

    def demote(self, ops) -> None:
        if self.fail_at is not None and self.fail_at < len(ops):
            raise DemotionFailed(ops[: self.fail_at], ops[self.fail_at :], RuntimeError("injected"))

    def start_promote(self, ops) -> None:
        k = len(ops) if self.fail_at is None else min(self.fail_at, len(ops))
        self.in_flight += ops[:k]
        if k < len(ops):
            raise PromotionFailed(ops[:k], ops[k:], RuntimeError("injected"))

    def poll_promotions(self) -> list:
        n = len(self.in_flight) if self.completing is None else self.completing
        done, self.in_flight = self.in_flight[:n], self.in_flight[n:]
        return done


def inner_pool(kv: KVManager):
    return kv.pool if kv.prefix_cache is None else kv.pool.inner


class KVManagerMachine(RuleBasedStateMachine):
    kv = None  # until setup

    @initialize(num_units=st.integers(4, 16), slots=st.integers(0, 5), sink=st.integers(0, 1),
                recent=st.integers(0, 2), caching=st.booleans(), sum_pool=st.booleans(),
                policy=st.sampled_from(["fcfs", "priority"]), max_seqs=st.integers(1, 4), budget=st.integers(2, 20))
    def setup(self, num_units, slots, sink, recent, caching, sum_pool, policy, max_seqs, budget):
        units = [[2 * u, 2 * u + 1] for u in range(num_units)]
        pool = SumBlockPool(SumState(units)) if sum_pool else FlatBlockPool(2 * num_units)
        self.kv = KVManager(pool, BS, slots, sink_pairs=sink, recent_pairs=recent,
                            prefix_cache=PrefixCache() if caching else None)
        self.scheduler = Scheduler(self.kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy)
        self.runner, self.seq_index = FakeRunner(), {}
        self.transitions = Transitions(None, self.kv, self.scheduler, self.runner, EventLog(), None, None,
                                       self.seq_index, 0)
        self.step_count, self.next_id = 0, 0

    # ---- between steps ---------------------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 9), max_size=8),
          max_tokens=st.integers(1, 16), prompt_logprobs=RARELY, choices=st.integers(1, 2),
          priority=st.integers(0, 2))
    def add_request(self, prefix, suffix, max_tokens, prompt_logprobs, choices, priority):
        prompt = [*prefix, *suffix] or [0]
        if self.kv.blocks_for(len(prompt) + max_tokens) > self.kv.pool.num_blocks:
            return  # LLMEngine.add_request refuses it (InvalidRequest)
        if len(self.scheduler.waiting) >= 4:
            return  # a longer queue only waits: steps, not arrivals, exercise the books
        params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=1 if prompt_logprobs else None)
        priority = priority if self.scheduler.by_priority else 0
        leader = None
        for _ in range(choices):  # n > 1: the later choices name the first as their prefix leader
            rid, self.next_id = f"r{self.next_id}", self.next_id + 1
            seq = Sequence(rid, list(prompt), len(prompt), params, SequenceMetrics(float(self.next_id)),
                           priority=priority)
            if self.kv.prefix_cache is not None and not prompt_logprobs and leader is not None:
                seq.prefix_leader = leader
            leader = leader or rid
            self.seq_index[rid] = self.next_id
            self.scheduler.add(seq)

    @rule(data=st.data(), everything=RARELY)
    def abort(self, data, everything):
        """Abort one request; now and then every request, which must give back every block and slot (what the
        cache retains counts as free), and then evict the cache, which must leave the inner pool full."""
        seqs = [*self.scheduler.running, *self.scheduler.waiting]
        for seq in seqs if everything else [data.draw(st.sampled_from(seqs))] if seqs else []:
            assert self.scheduler.abort(seq.request_id) is seq
            del self.seq_index[seq.request_id]
        if not everything:
            return
        kv, cache = self.kv, self.kv.prefix_cache
        assert kv.pool.num_free(False) == kv.pool.num_blocks
        assert kv.num_free_slots == kv.num_host_slots and not kv.promotions_in_flight() and not kv._base_runs
        if cache is not None:
            assert all(cache.refs(key) == 0 for key in cache._entries)
            retain = cache.retain
            kv.set_cache_retention(False)  # what sync_mode does when a residual goes stale
            assert len(cache) == 0
            kv.set_cache_retention(retain)
        assert inner_pool(kv).num_free(False) == kv.pool.num_blocks

    @rule(data=st.data())
    def step(self, data):
        """``LLMEngine.step`` with the control plane's answers drawn: publish promotions, pressure (demotions,
        preemptions), schedule, recovery (promotions, cache retention as ``sync_mode`` sets it), execute."""
        self.step_count += 1
        in_flight = len(self.runner.in_flight)
        self.runner.completing = data.draw(st.sampled_from([None, None, *range(in_flight)]), label="copies done")
        self.transitions.publish_promotions(self.step_count)
        self.books_balance()
        self.scheduler.dry_run()  # the pressure probe (memoizes hashes, changes no books)
        demote, fail_at, preempt = data.draw(PRESSURE, label="pressure")
        if demote:
            self.runner.fail_at = fail_at
            before = self.kv.num_free_blocks()
            done = self.transitions.demote(demote, self.step_count)
            assert self.kv.num_free_blocks() == before + done  # each started demotion frees its B block
            self.books_balance()
        if preempt:
            self.transitions._preempt_blocks(preempt, self.step_count, "pressure")
            self.books_balance()
        batch = self.scheduler.schedule()
        self.books_balance()
        promote, fail_at, retain = data.draw(RECOVERY, label="recovery")
        if promote:
            self.runner.fail_at = fail_at
            self.transitions.promote(promote, self.step_count)
            self.books_balance()
        if retain is not None and self.kv.prefix_cache is not None:
            self.kv.set_cache_retention(retain)
            self.books_balance()
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):  # LLMEngine._postprocess
            samples = batch.samples(i)
            self.kv.record_exposure(seq, seq.num_computed_tokens + n)
            seq.num_computed_tokens += n
            self.kv.register_pairs(seq)
            if not samples:
                continue
            seq.token_ids.append(data.draw(st.integers(0, 9), label="token"))
            if seq.num_output_tokens >= seq.params.max_tokens or data.draw(RARELY, label="eos"):
                self.scheduler.finish(seq)
                del self.seq_index[seq.request_id]

    # ---- the books -------------------------------------------------------------------------------------------
    @invariant()
    def books_balance(self):
        if self.kv is None:
            return
        kv, cache = self.kv, self.kv.prefix_cache
        owner: dict[int, object] = {}

        def own(block, who):
            assert owner.setdefault(block, who) == who, f"block {block} owned by {owner[block]} and by {who}"

        refs, slot_keys = Counter(), set()
        for seq in self.scheduler.waiting:
            assert not seq.block_table and not seq.pair_states and not seq.cache_held and not seq.num_computed_tokens
        for seq in self.scheduler.running:
            rid, table, states, held = seq.request_id, seq.block_table, seq.pair_states, seq.cache_held
            assert len(states) == -(-len(table) // 2) and seq.num_computed_tokens <= len(table) * BS
            assert len(held) <= kv.num_complete_pairs(seq)
            for p, state in enumerate(states):
                blocks = table[2 * p : 2 * p + 2]
                if state is PairState.TARGET:
                    assert len(set(blocks)) == len(blocks)
                    who = (rid, p)
                    if p < len(held) and held[p]:
                        who = seq.pair_hashes[p]
                        refs[who] += 1
                        assert cache._entries[who].blocks == tuple(blocks)
                else:  # BASE or PROMOTING: one packed block for both logical blocks, and a host slot
                    assert len(blocks) == 2 and blocks[0] == blocks[1] and not (p < len(held) and held[p])
                    slot_keys.add((rid, p))
                    who = (rid, p)
                    op = kv._promotions.get((rid, p))
                    assert (op is not None) == (state is PairState.PROMOTING)
                    if op is not None:
                        assert op.packed_block == blocks[0] and op.slot == kv._slots[(rid, p)]
                        assert any(op is o for o in self.runner.in_flight), "a PROMOTING pair's op is not in flight"
                        own(op.dst_a, ("reserved", rid, p))
                        own(op.dst_b, ("reserved", rid, p))
                for block in blocks:
                    own(block, who)
            base = [p for p, s in enumerate(states) if s is not PairState.TARGET]
            bounds = (0, 0) if not base else (base[0], base[-1] + 1) if base[-1] + 1 - base[0] == len(base) else None
            assert kv.base_bounds(seq) == bounds and (rid in kv._base_runs) == bool(base)
            shared = {p for p, h in enumerate(held) if h and cache.refs(seq.pair_hashes[p]) > 1}
            walk = [p for p in range(kv.sink_pairs, kv.num_complete_pairs(seq) - kv.recent_pairs)
                    if states[p] is PairState.TARGET and p not in shared]  # sinks, recent and shared pairs stay
            assert kv.demotable_pairs(seq) == walk and kv.num_demotable_pairs(seq) == len(walk)
            assert [p for p in range(len(states)) if kv.is_demotable(seq, p)] == walk
        assert set(kv._slots) == slot_keys and set(kv._base_runs) <= {s.request_id for s in self.scheduler.running}
        assert sorted([*kv._slots.values(), *kv._free_slots]) == list(range(kv.num_host_slots))
        if cache is not None:
            for key, entry in cache._entries.items():
                assert entry.refs == refs[key] and (key in cache._retained) == (entry.refs == 0)
                for block in entry.blocks:
                    own(block, key)
            assert set(refs) <= set(cache._entries) and (cache.retain or not cache._retained)
        inner = inner_pool(kv)
        assert len(owner) + inner.num_free(False) == kv.pool.num_blocks
        if isinstance(inner, FlatBlockPool):
            assert not set(owner) & set(inner._free)
        else:
            inner.state.check_invariants()
        assert kv.pool.num_free(False) + kv.pool.num_allocated() == kv.pool.num_blocks
        counts = kv.counts()
        states = Counter(s for seq in self.scheduler.running for s in seq.pair_states)
        assert counts["base_pairs"] == states[PairState.BASE]
        assert counts["promoting_pairs"] == states[PairState.PROMOTING]
        for seq in self.scheduler.running:  # the lists' own counts (read every step instead of scanning)
            assert seq.pair_states.num_base == seq.pair_states.count(PairState.BASE)
            assert seq.pair_states.num_not_target == len(seq.pair_states) - seq.pair_states.count(PairState.TARGET)
            assert kv.num_demotable_pairs(seq) == len(kv.demotable_pairs(seq))
        assert 0 <= kv.exposure.base_tokens <= kv.exposure.attended_tokens
        assert 0 <= kv.num_promotions <= kv.num_demotions


KVManagerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=80, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_kv_manager_state_machine = KVManagerMachine.TestCase
