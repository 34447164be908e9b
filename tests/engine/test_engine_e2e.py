"""End to end on the CPU: the engine's greedy outputs in static-fp16 equal a plain transformers forward token for
token (chunked prefill and batching included); a request forced through pair demotion and promotion finishes and
its KV is bit-exact after promotion; a request spanning full -> fast -> full finishes, is never recomputed, and the
residual bytes (clobbered by KV use while evicted) are restored bit-exactly; aborts and preemption return every block.
A tiny random Llama keeps it fast; test_smollm2_e2e.py runs the real SmolLM2-135M."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import transformers  # test dependency: the reference forward
from scripted_policies import EvictThenRestore, ScriptedPolicy, snapshot_pairs
from tiny_models import tiny_llama_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.errors import InvalidRequest
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.models import build_model
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.sequence import PairState

# The tiny-model tests also run on a GPU; the SmolLM2 ones need the PyPI GGUF, which only the CPU machines carry.
pytestmark = [pytest.mark.cpu]


def block_size_for(device) -> int:
    """4 on the CPU (many blocks and pairs from short prompts); 16 on a GPU, whose tl.dot tiles need >= 16 rows."""
    return 4 if device.type == "cpu" else 16


def block_bytes(block: int) -> int:
    return 3 * 2 * 2 * block * 16 * 2  # layers * (k|v) * kv heads * block * head_dim * fp16
PROMPTS = [[5, 9, 13, 2, 77, 31, 8], [101, 3, 3, 44], list(range(40, 61))]


@pytest.fixture(scope="module")
def tiny_llama():
    """A random Llama whose weights are exactly fp16 values, so both sides multiply the same numbers."""
    config = tiny_llama_config()
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    state = {name: t.half() for name, t in hf.state_dict().items()}
    hf.load_state_dict({name: t.float() for name, t in state.items()})
    return config, hf, state


def make_engine(tiny_llama, device, scripted=None, **overrides) -> LLMEngine:
    config, _, state = tiny_llama
    model = build_model(config.to_dict(), dtype=torch.float16, device=device)
    model.load_weights(state.items())
    block = block_size_for(device)
    options = dict(
        model="tiny-llama", device=device.type, block_size=block, max_num_batched_tokens=16, max_num_seqs=4,
        kv_cache_budget=96 * block_bytes(block), enforce_eager=False, sink_pairs=1, recent_pairs=1,
    )  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), model=model, policy=scripted, eos_token_ids=())


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    # The mask is explicit: without it generate masks every prompt token equal to pad_token_id (the 99-token prompt
    # of the n-choices test has a 0 at position 66, and the reference then disagreed with a plain forward).
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.cuda
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_static_fp16_greedy_matches_transformers(tiny_llama, device, enforce_eager):
    engine = make_engine(tiny_llama, device, enforce_eager=enforce_eager)
    assert (engine.runner.graphs is not None) == (device.type == "cuda" and not enforce_eager)
    results = engine.generate(PROMPTS, GREEDY)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == hf_greedy(tiny_llama[1], prompt, GREEDY.max_tokens)
        assert result.finish_reason == "length"
    assert engine.kv.pool.num_free(False) == engine.kv.pool.num_blocks
    assert engine.stats()["base_exposure"] == 0.0


@pytest.mark.cuda
def test_start_up_objects_are_frozen_until_close(tiny_llama, device):
    """On a GPU the engine moves what start-up built out of the collector's generations (no full collection walks
    it inside a step) and thaws it in ``close``; the CPU engine, which tests build by the dozen, leaves gc alone."""
    gc.unfreeze()
    engine = make_engine(tiny_llama, device)
    assert (gc.get_freeze_count() > 0) == (device.type == "cuda")
    assert len(engine.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    engine.close()
    engine.close()  # a second close does nothing
    assert gc.get_freeze_count() == 0


def promote_and_finish(engine, seq, before, max_tokens: int) -> None:
    """Step until every pair of ``seq`` is TARGET (published at a later step boundary, once the copy + unpack event
    has completed), check the promoted blocks against ``before`` bit for bit, then run the request to its end."""
    for _ in range(50):
        if all(s is PairState.TARGET for s in seq.pair_states):
            break
        engine.step()
    assert all(s is PairState.TARGET for s in seq.pair_states)
    kv = engine.runner.kv_cache
    for p, (a, b) in before.items():
        assert torch.equal(kv[seq.block_table[2 * p]], a) and torch.equal(kv[seq.block_table[2 * p + 1]], b)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].num_output_tokens == max_tokens


def request_with_pairs(tiny_llama, device):
    """An elastickv engine with a scripted policy and one request of 20 tokens after its prefill and two decodes,
    with at least two demotable pairs: (engine, policy, sequence, those pairs' fp16 blocks)."""
    policy = ScriptedPolicy()
    engine = make_engine(tiny_llama, device, scripted=policy, policy="elastickv")
    prompt = list(range(40, 40 + 9 * block_size_for(device)))  # 4 complete pairs and a half
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    seq = engine.scheduler.find("r")
    while seq.in_prefill or seq.num_output_tokens < 2:  # chunked prefill, then two decodes
        engine.step()
    before = snapshot_pairs(engine, "r")
    assert len(before) >= 2
    return engine, policy, seq, before


def demoted_request(tiny_llama, device):
    """``request_with_pairs`` with those pairs demoted."""
    engine, policy, seq, before = request_with_pairs(tiny_llama, device)
    policy.demote_next = True
    engine.step()
    assert [seq.pair_states[p] for p in before] == [PairState.BASE] * len(before)
    return engine, policy, seq, before


@pytest.mark.cuda
def test_demotion_then_promotion_is_bit_exact(tiny_llama, device):
    engine, policy, seq, before = demoted_request(tiny_llama, device)
    assert engine.stats()["base_pairs"] == len(before)
    for _ in range(3):
        engine.step()
    assert engine.stats()["base_exposure"] > 0.0
    policy.promote_next = True
    engine.step()  # starts the promotion: blocks reserved, readers still see BASE
    promote_and_finish(engine, seq, before, 20)
    assert all(0 <= t < tiny_llama[0].vocab_size for t in seq.output_token_ids)
    counts = engine.events.counts()
    assert counts["demote"] == 1 and counts["promote_start"] == 1 and counts["promote_done"] == 1
    assert engine.kv.pool.num_free(False) == engine.kv.pool.num_blocks and engine.kv.num_free_slots > 0


@pytest.mark.cuda
def test_abort_frees_blocks_and_preemption_recovers(tiny_llama, device):
    engine = make_engine(tiny_llama, device)
    pool = engine.kv.pool
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    block = block_size_for(device)
    needs = [-(-(len(p) + params.max_tokens) // block) for p in (PROMPTS[0], PROMPTS[2])]
    leave = max(needs)  # each fits alone, both together do not
    assert leave < sum(needs)
    pool.allocate(pool.num_blocks - leave, False)  # whatever the device's unit size made of the pool
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()
    engine.step()
    assert engine.abort_request("r1") and not engine.abort_request("r1")
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"r0", "r2"}
    assert engine.stats()["preemptions"] >= 1  # 8 blocks cannot hold r0 (4 blocks) and r2 (8 blocks) to the end
    assert all(out.num_output_tokens == 8 for out in finished.values())
    assert pool.num_free(False) == leave


@pytest.mark.cuda
def test_invalid_requests_are_rejected(tiny_llama, device):
    engine = make_engine(tiny_llama, device, kv_cache_budget=8 * block_bytes(block_size_for(device)))
    # the pool (CPU) or max_model_len (a GPU unit holds more than 250 tokens) bounds it
    too_long = min(engine.kv.pool.num_blocks * block_size_for(device), 250)
    with pytest.raises(InvalidRequest, match=r"KV blocks|max_model_len"):
        engine.add_request("big", list(range(too_long)), SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.add_request("p", [1, 2], SamplingParams(top_p=0.0))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.add_request("v", [1, 999], SamplingParams())


def nested_linears(model):
    from elastiserve.kernels.nested_linear import NestedLinear

    return {name: m for name, m in model.named_modules() if isinstance(m, NestedLinear) and m.is_nested}


def step_until_full_precision(engine) -> None:
    """Step until every layer is back in full precision (the restore worker copies on its own thread)."""
    for _ in range(400):
        engine.step()
        if not engine.runner.fast_layers:
            break
        time.sleep(0.005)
    assert engine.runner.fast_layers == frozenset()


@pytest.mark.cuda
def test_full_fast_full_switch_restores_weights_bit_exactly(tiny_llama, device):
    from elastiserve.kernels import formats

    engine = make_engine(tiny_llama, device, scripted=EvictThenRestore(evict_at=3, restore_from=5), policy="dps")
    reference = build_model(tiny_llama[0].to_dict(), dtype=torch.float16, device=device)
    reference.load_weights(tiny_llama[2].items())
    original_weights = {name: m.weight for name, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    linears = nested_linears(engine.model)
    assert linears, "dps must nest the decoder's linears"
    lower_before = {name: m.lower.clone() for name, m in linears.items()}
    prompt = PROMPTS[0]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    seq = engine.scheduler.find("r")
    for _ in range(3):
        engine.step()
    assert engine.runner.fast_layers == frozenset(range(3))
    # Use the reclaimed units as KV would: overwrite every free block, which clobbers the evicted residual bytes.
    pool = engine.kv.pool
    blocks = pool.allocate(pool.num_free(False), False)
    engine.runner.kv_cache[blocks] = torch.randn_like(engine.runner.kv_cache[blocks])
    pool.free(blocks)
    assert any(not torch.equal(m.lower, lower_before[n]) for n, m in linears.items()), "units are dual-mapped"
    step_until_full_precision(engine)
    for name, m in linears.items():
        assert torch.equal(m.lower, lower_before[name]), name
        assert torch.equal(formats.merge(m.upper, m.lower, m.nesting, m.weight_exp), original_weights[name]), name
    while engine.has_unfinished():
        engine.step()
    assert seq.num_output_tokens == 12 and seq.metrics.preemptions == 0  # spanned two switches, never recomputed
    assert 0 < seq.metrics.fast_mode_tokens < 12
    expected = hf_greedy(tiny_llama[1], prompt, 3)
    assert seq.output_token_ids[:3] == expected  # tokens before the switch came from exact fp16 weights
    counts = engine.events.counts()
    assert counts["mode_fast"] == 1 and counts["mode_full"] >= 1 and counts["restore_done"] >= 1


@pytest.mark.cuda
def test_queue_fast_runs_fp8_while_prompts_wait_and_returns_without_restore(tiny_llama, device):
    """dps with ``queue_fast_after_s``: every layer runs FP8 while some request has no first token, with nothing
    evicted, and full precision comes back at the next step once all have one (hold 0 here), with no restore."""
    from elastiserve.control.arbiter import Arbiter
    from elastiserve.control.config import preset

    control = preset("dps").with_engine_admission().with_precision(queue_fast_s=1e-6, queue_fast_hold_s=0.0)
    engine = make_engine(tiny_llama, device, scripted=Arbiter(control, a_max=64), policy="dps", queue_fast_after_s=1e-6)
    lower_before = {name: m.lower.clone() for name, m in nested_linears(engine.model).items()}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    seqs = [engine.scheduler.find(f"r{i}") for i in range(len(PROMPTS))]
    engine.step()
    assert engine.runner.fast_layers == frozenset(range(3))
    assert engine.runner.pool.block_pool.state.fast_layers == frozenset()  # run fast, evict nothing
    while any(seq.num_output_tokens == 0 for seq in seqs):
        engine.step()
    engine.step()  # every request has its first token: full again
    assert engine.runner.fast_layers == frozenset()
    while engine.has_unfinished():
        engine.step()
    assert [seq.num_output_tokens for seq in seqs] == [10] * len(PROMPTS)
    assert all(seq.metrics.fast_mode_tokens > 0 and seq.metrics.preemptions == 0 for seq in seqs)
    for name, m in nested_linears(engine.model).items():
        assert torch.equal(m.lower, lower_before[name]), name
    counts = engine.events.counts()
    assert counts["mode_fast"] == 1 and counts["mode_full"] == 1
    assert not {"evict_residual", "restore_start", "restore_done"} & set(counts)


@pytest.mark.cuda
def test_prefill_fast_runs_fp8_exactly_on_the_steps_that_carry_a_prefill_chunk(tiny_llama, device):
    """dps with ``prefill_fast``: a step with a prefill chunk (16-token budget: the 21-token prompt spans steps, and
    a request added mid-run prefills between decode steps) runs every layer FP8 with nothing evicted; every
    decode-only step runs full; the lower planes never change and every request finishes unrecomputed."""
    from elastiserve.control.arbiter import Arbiter
    from elastiserve.control.config import preset

    control = preset("dps").with_engine_admission().with_precision(prefill_fast=True)
    engine = make_engine(tiny_llama, device, scripted=Arbiter(control, a_max=64), policy="dps", prefill_fast=True)
    lower_before = {name: m.lower.clone() for name, m in nested_linears(engine.model).items()}
    seen: list[tuple[bool, frozenset]] = []
    execute = engine.runner.execute

    def spy(batch, kv):
        seen.append((batch.is_decode_only, engine.runner.fast_layers))
        return execute(batch, kv)

    engine.runner.execute = spy
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    seqs = [engine.scheduler.find(f"r{i}") for i in range(len(PROMPTS))]
    for _ in range(6):
        engine.step()
    engine.add_request("late", PROMPTS[0], params)
    seqs.append(engine.scheduler.find("late"))
    while engine.has_unfinished():
        engine.step()
    every = frozenset(range(3))
    assert all(fast == (frozenset() if decode_only else every) for decode_only, fast in seen), seen
    assert sum(not d for d, _ in seen) >= 3 and sum(d for d, _ in seen) >= 5
    assert [d for d, _ in seen].index(True) < max(i for i, (d, _) in enumerate(seen) if not d)  # late prefill
    assert all(seq.num_output_tokens == 10 and seq.metrics.preemptions == 0 for seq in seqs)
    for name, m in nested_linears(engine.model).items():
        assert torch.equal(m.lower, lower_before[name]), name
    assert engine.runner.pool.block_pool.state.fast_layers == frozenset()
    assert not {"evict_residual", "restore_start", "restore_done"} & set(engine.events.counts())


def test_queue_fast_needs_a_policy_that_switches_precision():
    from elastiserve.platforms import ConfigError

    for policy in ("static-fp16", "static-fp8", "elastickv"):
        with pytest.raises(ConfigError, match="queue_fast_after_s"):
            EngineConfig(model="x", policy=policy, queue_fast_after_s=1.0)
        with pytest.raises(ConfigError, match="prefill_fast"):
            EngineConfig(model="x", policy=policy, prefill_fast=True)
    assert EngineConfig(model="x", policy="combined", queue_fast_after_s=1.0).queue_fast_after_s == 1.0
    from elastiserve.engine.transitions import make_policy

    held = make_policy(EngineConfig(model="x", policy="combined", queue_fast_after_s=0.1, queue_fast_hold_s=0.25))
    assert (held.config.precision.queue_fast_s, held.config.precision.queue_fast_hold_s) == (0.1, 0.25)
    default = make_policy(EngineConfig(model="x", policy="dps", queue_fast_after_s=0.1)).config.precision
    assert default.queue_fast_hold_s == 2.0 and not default.prefill_fast  # the control defaults
    prefill = make_policy(EngineConfig(model="x", policy="combined", prefill_fast=True)).config.precision
    assert prefill.prefill_fast and prefill.queue_fast_s is None
    with pytest.raises(ConfigError, match="queue_fast_hold_s"):
        EngineConfig(model="x", policy="dps", queue_fast_hold_s=0.5)  # a hold without the queue rule
    with pytest.raises(ConfigError, match="queue_fast_hold_s"):
        EngineConfig(model="x", policy="dps", queue_fast_after_s=1.0, queue_fast_hold_s=-1.0)


@pytest.mark.cuda
def test_dps_reads_residual_units_as_weights_not_kv(tiny_llama, device):
    """The DPS policy sees the KV pool's occupancy, not the units that hold resident residuals: a short request on
    an empty pool evicts nothing (counting residual-held blocks as used once read an empty pool as full, 30x over
    for SmolLM2 in the demo, and evicted every layer at the first step); a burst larger than the pool does evict,
    and the stats count only what KV can use."""
    block = block_size_for(device)
    # A GPU pool is whole 2 MiB VMM units (341 of this model's 16-token blocks): its burst needs more, longer rows,
    # and a token budget that lets all of them run at once (16 tokens a step kept at most 16 rows decoding, 240
    # blocks: the H200 run never pressed the pool).
    seqs, prompt_blocks, output_blocks = (8, 3, 6) if device.type == "cpu" else (32, 12, 3)
    budget = 16 if device.type == "cpu" else 512
    engine = make_engine(tiny_llama, device, policy="dps", kv_cache_budget=16 * block_bytes(block), max_num_seqs=seqs,
                         max_num_batched_tokens=budget)  # fmt: skip
    stats = engine.stats()
    assert stats["kv_blocks"] < stats["total_blocks"] and stats["kv_usage"] == 0.0
    assert seqs * (prompt_blocks + output_blocks) > stats["kv_blocks"]  # the burst overfills the KV-only pool
    engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert engine.events.counts().get("evict_residual", 0) == 0 and engine.stats()["mode"] == "full"
    burst = [[(7 * i + j) % 200 for j in range(prompt_blocks * block)] for i in range(seqs)]
    engine.generate(burst, SamplingParams(temperature=0.0, max_tokens=output_blocks * block, ignore_eos=True))
    assert engine.events.counts().get("evict_residual", 0) >= 1 and engine.stats()["preemptions"] == 0


def test_elastickv_demotes_past_one_slot_per_initial_pair(tiny_llama, device):
    """A freed block is refilled and demoted in turn, so BASE pairs can outnumber the pool's initial pairs: the host
    backing holds one slot per block. With one per initial pair the quarter-scale dense run ran out of slots and
    preempted with demotable pairs left; here the burst needs more BASE pairs than that and must not preempt. CPU
    only: a GPU pool is whole 2 MiB units (341 blocks of this model), more than its 256-token rows can press."""
    from elastiserve.control.arbiter import Arbiter
    from elastiserve.control.config import preset
    from elastiserve.control.kv_fidelity import capacity_guard

    block = block_size_for(device)
    seqs = 6
    # Unbounded admission ("free"), so that the burst outgrows half the pool in BASE: the engine's base-floor bound
    # would admit only three rows here (22 blocks each at their floor, in 120 less 32 of headroom).
    unbounded = Arbiter(preset("elastickv").with_kv(demand_includes_admissions=True), capacity_guard(seqs, 16, block))
    engine = make_engine(tiny_llama, device, scripted=unbounded, policy="elastickv", max_num_seqs=seqs,
                         kv_cache_budget=96 * block_bytes(block))  # fmt: skip
    pool_blocks = engine.kv.pool.num_blocks
    assert engine.runner.host_backing.shape[0] == pool_blocks
    # Each row needs 40 blocks; with one sink and one recent pair kept TARGET, 18 of its 20 pairs can be BASE.
    prompt_blocks = 30
    burst = [[(11 * i + j) % 200 for j in range(prompt_blocks * block)] for i in range(seqs)]
    most_base = 0
    for i, prompt in enumerate(burst):
        engine.add_request(f"b{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10 * block, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        most_base = max(most_base, engine.stats()["base_pairs"])
    assert seqs * (prompt_blocks + 10) > pool_blocks + pool_blocks // 2 + 1  # more than the old slots could free
    assert most_base > pool_blocks // 2 + 1 and engine.stats()["preemptions"] == 0


class AsciiVocab:
    """Token i < 128 is the byte i; the rest are special (never generated under a guide) and 210 is EOS."""

    EOS = 210

    def token_bytes(self):
        return [bytes([i]) if i < 128 else None for i in range(211)]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 128).decode()


@pytest.mark.cuda
def test_guided_requests_survive_preemption_and_stop_when_complete(tiny_llama, device):
    """Two guided requests that cannot both hold their blocks: one is preempted and recomputed, and both outputs are
    still documents of the grammar (or, at max_tokens, alive prefixes of one); a document that completes ends the
    request with "stop" before max_tokens."""
    from elastiserve.engine.guided.grammar import json_schema_grammar

    engine = make_engine(tiny_llama, device)
    engine.tokenizer, engine.eos_token_ids = AsciiVocab(), frozenset({AsciiVocab.EOS})
    grammar = json_schema_grammar({"type": "array", "items": {"enum": ["ab", 7]}, "minItems": 1, "maxItems": 2})
    pool = engine.kv.pool
    params = SamplingParams(temperature=0.0, max_tokens=12, guide=grammar)
    block = block_size_for(device)
    # Two prompts of two blocks less a token: both prefills fit, each request fits alone, and the shortest document
    # (6 tokens) takes each into its third block, which the two cannot both have (on a GPU's 16-token blocks too).
    prompts = [[(5 * i + j) % 120 for j in range(2 * block - 1)] for i in (1, 2)]
    alone = -(-(2 * block - 1 + params.max_tokens) // block)
    free = max(4, alone)
    assert 2 * -(-(2 * block - 1 + 6) // block) > free
    pool.allocate(pool.num_blocks - free, False)
    engine.add_request("r0", prompts[0], params)
    engine.add_request("r2", prompts[1], params)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.stats()["preemptions"] >= 1
    automaton = grammar.automaton
    for out in finished.values():
        text = out.text.encode()
        state = automaton.feed(automaton.start(), text)
        assert state, text
        if out.finish_reason == "stop":
            assert automaton.matches(text) and out.num_output_tokens <= params.max_tokens
        else:
            assert out.finish_reason == "length" and out.num_output_tokens == params.max_tokens
