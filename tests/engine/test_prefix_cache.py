"""Automatic prefix caching: the cache's reference counts and least-recently-released eviction, the caching pool's
free count (retained blocks count as free and are evicted on demand), the KV manager's matching, registration,
demotion rules (a shared pair is never demoted, an unshared one leaves the cache) and block books, and end to end:
a request whose prompt starts like an earlier one skips those pairs and still gives the transformers reference's
greedy tokens, also after a preemption."""

from __future__ import annotations

import random

import pytest
from test_engine_e2e import (  # noqa: F401  (tiny_llama: a fixture)
    block_size_for,
    hf_greedy,
    make_engine,
    step_until_full_precision,
    tiny_llama,
)

from elastiserve.engine import cli
from elastiserve.engine.config import EngineConfig
from elastiserve.engine.errors import EngineError
from elastiserve.engine.kv_manager import FlatBlockPool, KVManager
from elastiserve.engine.prefix_cache import CachingBlockPool, PrefixCache, pair_hash
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import Scheduler
from elastiserve.engine.sequence import PairState, Sequence, SequenceMetrics

pytestmark = [pytest.mark.cpu]

BS = 4  # pairs of 8 tokens


def test_retained_pairs_are_evicted_least_recently_released_first():
    cache = PrefixCache()
    keys = [pair_hash(None, [i, i]) for i in range(3)]
    for i, key in enumerate(keys):
        cache.insert(key, (2 * i, 2 * i + 1))
    assert cache.num_retained_blocks == 0 and cache.evict(2) == []  # all in use
    cache.release(keys[2])
    cache.release(keys[0])
    assert cache.num_retained_blocks == 4
    assert cache.acquire(keys[2]) == (4, 5) and cache.num_retained_blocks == 2  # in use again
    assert cache.evict(1) == [0, 1] and keys[0] not in cache
    with pytest.raises(EngineError, match="registered twice"):
        cache.insert(keys[1], (9, 9))
    cache.release(keys[1])
    with pytest.raises(EngineError, match="released more often"):
        cache.release(keys[1])
    assert cache.acquire(keys[1]) == (2, 3)
    cache.acquire(keys[1])
    with pytest.raises(EngineError, match="2 users"):
        cache.forget(keys[1])
    assert pair_hash(keys[0], [1, 2]) != pair_hash(keys[1], [1, 2])  # the same tokens after another prefix


def test_caching_pool_counts_retained_blocks_as_free_and_evicts_them_on_demand():
    cache = PrefixCache()
    pool = CachingBlockPool(FlatBlockPool(6), cache)
    blocks = pool.allocate(4)
    cache.insert(b"a", (blocks[0], blocks[1]))
    cache.insert(b"b", (blocks[2], blocks[3]))
    cache.release(b"a")
    assert pool.num_free() == 4 and pool.num_allocated() == 2
    assert pool.allocate(5) is None  # 2 free + 2 retained
    assert len(pool.allocate(3)) == 3  # the retained pair is evicted for it
    assert b"a" not in cache and b"b" in cache and pool.num_free() == 1


def make_seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, list(tokens), len(tokens), SamplingParams(), SequenceMetrics(0.0))


def prefill(kv: KVManager, seq: Sequence) -> Sequence:
    assert kv.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.register_pairs(seq)
    return seq


def test_a_matching_prompt_takes_the_cached_pairs_and_a_shared_pair_is_never_demoted():
    kv = KVManager(FlatBlockPool(64), BS, 16, sink_pairs=0, recent_pairs=0, prefix_cache=PrefixCache())
    first = prefill(kv, make_seq("a", range(30)))  # 3 complete pairs (24 tokens) and a partial one
    assert len(kv.prefix_cache) == 3 and first.cache_held == [True] * 3
    second = make_seq("b", [*range(24), 99, 98])  # the same 3 pairs, then other tokens
    assert kv.match_prefix(second) == 24
    assert second.block_table == first.block_table[:6] and second.num_uncomputed_tokens == 2
    assert kv.demotable_pairs(first) == [] and kv.num_demotable_pairs(first) == 0  # every complete pair is shared
    kv.free_sequence(first)  # the pairs stay: `b` uses them
    assert kv.demotable_pairs(second) == [0, 1, 2]  # now its own user alone
    op = kv.demote(second, 1)
    assert second.pair_states[1] is PairState.BASE and not second.cache_held[1] and len(kv.prefix_cache) == 2
    kv.release_demoted([op])
    kv.free_sequence(second)
    assert kv.pool.num_free(False) == 64 and kv.prefix_cache.num_retained_blocks == 4  # pairs 0 and 2 retained
    third = make_seq("c", [*range(24), 7])
    assert kv.match_prefix(third) == 8  # pair 1 was demoted and left the cache: the chain stops there
    whole = make_seq("d", range(24))
    assert kv.match_prefix(whole) == 8  # one token is always left to compute (at most 23 of 24 from the cache)
    scored = Sequence("e", list(range(30)), 30, SamplingParams(prompt_logprobs=1), SequenceMetrics(0.0))
    assert kv.match_prefix(scored) == 0  # prompt logprobs need every prompt position computed


def test_the_dry_run_demands_only_the_uncached_part_of_a_queued_prompt():
    kv = KVManager(FlatBlockPool(64), BS, 16, prefix_cache=PrefixCache())
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    kv.free_sequence(prefill(kv, make_seq("a", range(30))))  # 3 pairs retained
    scheduler.add(make_seq("b", [*range(24), 5, 6, 7]))  # 24 of 27 tokens cached: 3 to compute, one block
    assert scheduler.dry_run().blocks_needed == 1
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [3] and scheduler.running[0].num_computed_tokens == 24


def test_books_stay_whole_over_random_sharing():
    """Random prompts over a few shared prefixes: admit (matching), prefill, demote unshared pairs, finish in any
    order. No block is owned twice, and once everything is freed and the cache emptied the pool is whole."""
    rng = random.Random(3)
    kv = KVManager(FlatBlockPool(400), BS, 64, sink_pairs=0, recent_pairs=0, prefix_cache=PrefixCache())
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    live: list[Sequence] = []
    for i in range(200):
        if live and (len(live) > 8 or rng.random() < 0.4):
            kv.free_sequence(live.pop(rng.randrange(len(live))))
        else:
            seq = make_seq(f"r{i}", rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))])
            kv.match_prefix(seq)
            if not kv.allocate(seq, seq.num_uncomputed_tokens):
                kv.unmatch(seq)
                continue
            seq.num_computed_tokens = seq.num_tokens
            kv.register_pairs(seq)
            live.append(seq)
            for pair in kv.demotable_pairs(seq)[: rng.randrange(2)]:
                kv.release_demoted([kv.demote(seq, pair)])
        owners: dict[int, set[str]] = {}
        for seq in live:
            for block in set(seq.block_table):
                owners.setdefault(block, set()).add(seq.request_id)
        shared = {b for seq in live for p, held in enumerate(seq.cache_held) if held
                  for b in seq.block_table[2 * p : 2 * p + 2]}  # fmt: skip
        assert all(len(o) == 1 or b in shared for b, o in owners.items())
        assert kv.pool.num_free(False) + len(owners) == 400  # free (retained included) and in use never overlap
    for seq in live:
        kv.free_sequence(seq)
    assert kv.pool.num_free(False) == 400
    kv.pool.inner.free(kv.prefix_cache.evict(400))
    assert kv.pool.inner.num_free(False) == 400 and len(kv.prefix_cache) == 0


def test_without_retention_released_pairs_go_back_to_the_pool():
    """While weight residuals are evicted the cache retains nothing: turning retention off frees what it held, and
    a pair whose last user leaves then returns to the pool; sharing among live sequences goes on."""
    kv = KVManager(FlatBlockPool(64), BS, 16, prefix_cache=PrefixCache())
    kv.free_sequence(prefill(kv, make_seq("a", range(30))))
    assert kv.prefix_cache.num_retained_blocks == 6 and kv.pool.inner.num_free(False) == 58
    kv.set_cache_retention(False)
    assert kv.prefix_cache.num_retained_blocks == 0 and kv.pool.inner.num_free(False) == 64
    first = prefill(kv, make_seq("b", range(30)))
    second = make_seq("c", [*range(24), 1])
    assert kv.match_prefix(second) == 24  # live pairs are still shared
    kv.free_sequence(first)
    kv.free_sequence(second)
    assert len(kv.prefix_cache) == 0 and kv.pool.inner.num_free(False) == 64
    kv.set_cache_retention(True)
    kv.free_sequence(prefill(kv, make_seq("d", range(30))))
    assert kv.prefix_cache.num_retained_blocks == 6


def test_prefix_caching_config_and_flag():
    for policy in ("static-fp16", "elastickv", "dps", "combined", "static-fp8"):
        assert EngineConfig(model="m", policy=policy, enable_prefix_caching=True).enable_prefix_caching
    args = cli.build_parser().parse_args(["serve", "smollm2", "--enable-prefix-caching"])
    assert cli.engine_settings(args)["enable_prefix_caching"] is True


@pytest.mark.cuda
def test_a_cached_prefix_gives_the_reference_tokens(tiny_llama, device):  # noqa: F811
    engine = make_engine(tiny_llama, device, enable_prefix_caching=True)
    pair = 2 * block_size_for(device)
    shared = [(7 * i + 3) % 200 for i in range(3 * pair + 5)]
    prompts = [[*shared, 11, 12, 13], [*shared, 50, 51]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = engine.generate(prompts[:1], params)[0]
    assert engine.stats()["prefix_cache_hit_tokens"] == 0
    second = engine.generate(prompts[1:], params)[0]
    assert engine.stats()["prefix_cache_hit_tokens"] == 3 * pair  # the shared pairs, not the partial one
    for prompt, result in zip(prompts, (first, second)):
        assert result.token_ids == hf_greedy(tiny_llama[1], prompt, params.max_tokens)
    stats = engine.stats()
    assert stats["prefix_cache_retained_blocks"] > 0
    assert engine.kv.pool.num_free(False) == engine.kv.pool.num_blocks  # retained blocks count as free


@pytest.mark.cuda
def test_a_preempted_request_comes_back_through_its_own_cached_pairs(tiny_llama, device):  # noqa: F811
    engine = make_engine(tiny_llama, device, enable_prefix_caching=True)
    pair = 2 * block_size_for(device)
    prompt = [(5 * i + 1) % 200 for i in range(4 * pair)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("r", prompt, params)
    seq = engine.scheduler.find("r")
    while seq.num_output_tokens < 3:
        engine.step()
    engine.scheduler.preempt(seq)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert engine.stats()["prefix_cache_hit_tokens"] >= 3 * pair  # at least the prompt's first three pairs
    assert seq.output_token_ids == hf_greedy(tiny_llama[1], prompt, params.max_tokens)
    assert outputs[-1].finished and seq.metrics.preemptions == 1


@pytest.mark.cuda
def test_cached_pairs_do_not_keep_an_evicted_model_in_fp8(tiny_llama, device):  # noqa: F811
    """dps with prefix caching: a finished request's pairs are retained in full precision; when every residual is
    evicted retention stops and frees them, and the restore brings the model back to full precision."""
    from scripted_policies import EvictThenRestore

    engine = make_engine(tiny_llama, device, scripted=EvictThenRestore(evict_at=8, restore_from=9), policy="dps",
                         enable_prefix_caching=True)
    pair = 2 * block_size_for(device)
    free_at_start = engine.kv.pool.num_free(False)  # units holding residuals are not free
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([[(3 * i + 2) % 200 for i in range(2 * pair + 1)]], params)
    assert engine.stats()["prefix_cache_retained_blocks"] == 4 and engine.runner.fast_layers == frozenset()
    engine.add_request("r", [(3 * i + 2) % 200 for i in range(2 * pair + 3)], SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True))
    while engine.step_count <= 8:
        engine.step()
    assert engine.runner.fast_layers == frozenset(range(3))
    assert engine.stats()["prefix_cache_retained_blocks"] == 0  # flushed: restore needs whole free units
    step_until_full_precision(engine)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.pool.num_free(False) == free_at_start  # the request's pairs are retained again, as free


@pytest.mark.cuda
def test_later_choices_wait_for_the_first_and_take_its_prompt_from_the_cache(tiny_llama, device):  # noqa: F811
    """``n`` choices of one prompt (the server's n > 1): the later ones are held while the first is in prefill, then
    take every complete pair of the prompt from the cache and compute only the partial pair; all three give the
    reference's greedy tokens. Without prefix caching the leader is ignored."""
    from elastiserve.engine.sequence import SequenceStatus

    engine = make_engine(tiny_llama, device, enable_prefix_caching=True)
    pair = 2 * block_size_for(device)
    prompt = [(3 * i + 2) % 200 for i in range(3 * pair + 3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"c{i}", prompt, params, prefix_leader=None if i == 0 else "c0")
    seqs = [engine.scheduler.find(f"c{i}") for i in range(3)]
    computed = dict.fromkeys(("c0", "c1", "c2"), 0)
    execute = engine.runner.execute

    def counting(batch, kv):
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            computed[seq.request_id] += n
        return execute(batch, kv)

    engine.runner.execute = counting
    while engine.has_unfinished():
        leader_in_prefill = seqs[0].in_prefill
        engine.step()
        if leader_in_prefill:
            assert all(seq.status is SequenceStatus.WAITING for seq in seqs[1:])
    expected = hf_greedy(tiny_llama[1], prompt, params.max_tokens)
    assert [seq.output_token_ids for seq in seqs] == [expected] * 3
    assert engine.stats()["prefix_cache_hit_tokens"] == 2 * 3 * pair  # both later choices: every complete pair
    assert computed == {"c0": len(prompt) + 7, "c1": 3 + 7, "c2": 3 + 7}  # prompt rows, then 7 decodes each
    assert all(seq.prefix_leader is None for seq in seqs)  # cleared at admission: a preempted choice is not held
    engine.add_request("late", prompt, params, prefix_leader="not-queued")
    assert engine.scheduler.find("late").prefix_leader is None  # a leader the engine does not have is ignored
    plain = make_engine(tiny_llama, device)
    plain.add_request("a", prompt, params)
    plain.add_request("b", prompt, params, prefix_leader="a")
    assert plain.scheduler.find("b").prefix_leader is None


@pytest.mark.cuda
def test_a_preempted_choice_ahead_of_its_leader_is_not_held(tiny_llama, device):  # noqa: F811
    """The leader preempted first and its choice second puts the choice at the queue's head, ahead of the leader;
    had it still been held, neither would ever run again."""
    engine = make_engine(tiny_llama, device, enable_prefix_caching=True)
    prompt = [(3 * i + 2) % 200 for i in range(2 * block_size_for(device) + 3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("c0", prompt, params)
    engine.add_request("c1", prompt, params, prefix_leader="c0")
    leader, choice = engine.scheduler.find("c0"), engine.scheduler.find("c1")
    while choice.num_output_tokens < 2:
        engine.step()
    engine.scheduler.preempt(leader)
    engine.scheduler.preempt(choice)
    assert list(engine.scheduler.waiting)[:2] == [choice, leader]
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    expected = hf_greedy(tiny_llama[1], prompt, params.max_tokens)
    assert leader.output_token_ids == expected and choice.output_token_ids == expected
