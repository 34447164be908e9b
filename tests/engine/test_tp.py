"""Tensor parallelism end to end on the CPU (gloo, one host VMM pool per rank): ``engine/tp.py`` had never run.

TP=2 against TP=1 on tiny random models written to a model directory (every rank loads it):
- static-fp16: greedy outputs equal token for token (Llama and Qwen3-MoE), also through an abort and a preemption;
- dps, forced full -> fast -> full: the request finishes, and every rank's residual bytes, clobbered by KV use while
  evicted, come back bit-exactly;
- elastickv, forced demotion and promotion: every rank's KV of the promoted pairs is bit-exact, tokens equal TP=1's;
- every rank's Algorithm 1 books equal rank 0's afterwards, and the workers exit with code 0 on ``engine.close()``;
- an engine idle for longer than the collective timeout keeps its workers (before, their wait for a plan timed out).
- the step plans carry the forward's inputs only, and seeded sampling with penalties and logprobs equals TP=1's.
Workers are reached through ``TPRunner.on_every_rank`` with the probes of ``tp_probes.py``.
"""

from __future__ import annotations

import time

import pytest
import torch
import tp_probes
import transformers
from safetensors.torch import save_file
from scripted_policies import ScriptedPolicy
from tiny_models import tiny_llama_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.sequence import PairState

pytestmark = [pytest.mark.cpu]

PROMPTS = [[5, 9, 13, 2, 77, 31, 8], [101, 3, 3, 44], list(range(40, 61))]
BLOCK = 4


def write_model_dir(path, config, seed: int, std: float | None = None):
    """A random model whose weights are exactly fp16, as config.json + model.safetensors."""
    torch.manual_seed(seed)
    hf = type_for(config)(config).eval()
    if std is not None:
        with torch.no_grad():
            for param in hf.parameters():
                param.normal_(0.0, std)
    state = {name: t.half().contiguous() for name, t in hf.state_dict().items()}
    config.save_pretrained(path)
    save_file(state, str(path / "model.safetensors"))
    return path


def type_for(config):
    return transformers.Qwen3MoeForCausalLM if config.model_type == "qwen3_moe" else transformers.LlamaForCausalLM


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    config = tiny_llama_config()
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"), config, seed=0)


@pytest.fixture
def engines():
    """Builds engines and closes every one of them, even when the test fails (no worker outlives its test)."""
    made = []

    def make(model_dir, tp: int, **overrides) -> LLMEngine:
        policy = overrides.pop("scripted", None)
        options = dict(
            model=str(model_dir), device="cpu", block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4,
            cpu_kv_blocks=96, enforce_eager=True, sink_pairs=1, recent_pairs=1, tensor_parallel_size=tp,
            tp_timeout_s=60.0,
        )  # fmt: skip
        options.update(overrides)
        engine = LLMEngine(EngineConfig(**options), policy=policy, eos_token_ids=())
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()


def close_and_check_workers(engine) -> None:
    workers = engine.tp_group.workers
    assert len(workers) == engine.config.tensor_parallel_size - 1
    engine.close()
    assert engine.tp_group is None
    assert [w.exitcode for w in workers] == [0] * len(workers)


def on_every_rank(engine, fn, *args) -> list:
    if engine.tp_group is None:
        return [fn(engine.runner, *args)]
    return engine.runner.on_every_rank(fn, *args)


def assert_books_agree(engine) -> None:
    books = on_every_rank(engine, tp_probes.books)
    assert books == [books[0]] * len(books)


def pair_blocks(seq, pairs) -> list[int]:
    return [seq.block_table[2 * p + half] for p in pairs for half in (0, 1)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


# (max_tokens, free blocks) per block size such that r0 and r2 cannot both finish without a preemption: with 16-token
# blocks 8 new tokens never cross a block boundary, so the GPU scenario generates 32 with 6 blocks free.
PREEMPT_SCENARIO = {4: (8, 8), 16: (32, 6)}


def greedy_abort_and_preempt(engine) -> tuple[list, dict]:
    """Greedy outputs of PROMPTS; then the same prompts with r1 aborted and too few free blocks (PREEMPT_SCENARIO),
    so that r0 and r2 cannot both finish without a preemption. Returns the tokens of both runs."""
    greedy = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    pool = engine.kv.pool
    max_tokens, free_blocks = PREEMPT_SCENARIO[engine.config.block_size]
    held = pool.allocate(pool.num_free(False) - free_blocks, False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
        seqs[f"r{i}"] = engine.scheduler.find(f"r{i}")
    engine.step()
    engine.step()
    assert engine.abort_request("r1")
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["preemptions"] >= 1
    pool.free(held)
    assert pool.num_free(False) == pool.num_blocks
    assert_books_agree(engine)
    return greedy, {rid: seq.output_token_ids for rid, seq in seqs.items() if rid != "r1"}


def test_static_fp16_tp2_equals_tp1(llama_dir, engines):
    """Greedy, abort and preemption: token for token, and every rank's books equal rank 0's."""
    expected = greedy_abort_and_preempt(engines(llama_dir, 1))
    engine = engines(llama_dir, 2)
    assert greedy_abort_and_preempt(engine) == expected
    close_and_check_workers(engine)


def test_dps_full_fast_full_switch_restores_every_ranks_residual(llama_dir, engines):
    from scripted_policies import EvictThenRestore

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        engine = engines(llama_dir, tp, policy="dps", scripted=EvictThenRestore(evict_at=3, restore_from=4))
        assert on_every_rank(engine, tp_probes.kv_heads) == [2 // tp] * tp
        lower_before = on_every_rank(engine, tp_probes.lower_planes)
        assert all(lower_before)
        engine.add_request("r", PROMPTS[0], params)
        seq = engine.scheduler.find("r")
        for _ in range(3):
            engine.step()
        assert engine.runner.fast_layers == frozenset(range(3))
        pool = engine.kv.pool  # overwrite every free block on every rank: the evicted residual bytes with them
        blocks = pool.allocate(pool.num_free(False), False)
        on_every_rank(engine, tp_probes.clobber_blocks, blocks)
        pool.free(blocks)
        for before, now in zip(lower_before, on_every_rank(engine, tp_probes.lower_planes)):
            assert any(not torch.equal(now[name], plane) for name, plane in before.items()), "units are dual-mapped"
        for _ in range(400):
            engine.step()
            if not engine.runner.fast_layers:
                break
            time.sleep(0.005)  # the restore workers copy on their own threads
        assert engine.runner.fast_layers == frozenset()
        for before, now in zip(lower_before, on_every_rank(engine, tp_probes.lower_planes)):
            for name, plane in before.items():
                assert torch.equal(now[name], plane), name
        while engine.has_unfinished():
            engine.step()
        assert seq.num_output_tokens == 6 and seq.metrics.preemptions == 0
        assert 0 < seq.metrics.fast_mode_tokens < 6
        assert all(0 <= t < 211 for t in seq.output_token_ids)
        counts = engine.events.counts()
        assert counts["mode_fast"] == 1 and counts["mode_full"] >= 1 and counts["restore_done"] >= 1
        assert_books_agree(engine)
        tokens[tp] = seq.output_token_ids
        if tp == 2:
            close_and_check_workers(engine)
    assert tokens[2][:2] == tokens[1][:2]  # steps 1 and 2 ran in full mode: exact fp16 weights on both


def test_elastickv_demote_promote_is_bit_exact_on_every_rank(llama_dir, engines):
    prompt = list(range(40, 40 + 9 * BLOCK))  # chunked prefill; 4 complete pairs and a half
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        policy = ScriptedPolicy()
        engine = engines(llama_dir, tp, policy="elastickv", scripted=policy)
        engine.add_request("r", prompt, params)
        seq = engine.scheduler.find("r")
        while seq.in_prefill or seq.num_output_tokens < 2:
            engine.step()
        pairs = engine.kv.demotable_pairs(seq)
        assert len(pairs) >= 2
        before = on_every_rank(engine, tp_probes.kv_blocks, pair_blocks(seq, pairs))
        policy.demote_next = True
        engine.step()
        assert [seq.pair_states[p] for p in pairs] == [PairState.BASE] * len(pairs)
        for _ in range(3):
            engine.step()
        policy.promote_next = True
        for _ in range(50):
            engine.step()
            if all(s is PairState.TARGET for s in seq.pair_states):
                break
        assert all(s is PairState.TARGET for s in seq.pair_states)
        after = on_every_rank(engine, tp_probes.kv_blocks, pair_blocks(seq, pairs))
        assert len(after) == tp and all(torch.equal(a, b) for a, b in zip(after, before))
        while engine.has_unfinished():
            engine.step()
        assert seq.num_output_tokens == 12 and all(0 <= t < 211 for t in seq.output_token_ids)
        counts = engine.events.counts()
        assert counts["demote"] == 1 and counts["promote_start"] == 1 and counts["promote_done"] == 1
        assert engine.kv.pool.num_free(False) == engine.kv.pool.num_blocks
        assert_books_agree(engine)
        tokens[tp] = seq.output_token_ids
        if tp == 2:
            close_and_check_workers(engine)
    assert tokens[2] == tokens[1]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=80, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    return write_model_dir(tmp_path_factory.mktemp("tiny-qwen3-moe"), config, seed=0, std=0.2)


def test_moe_static_fp16_tp2_equals_tp1(moe_dir, engines):
    prompts = [[5, 9, 13, 2, 77, 31, 8], list(range(20, 41))]
    expected = [r.token_ids for r in engines(moe_dir, 1).generate(prompts, GREEDY)]
    engine = engines(moe_dir, 2)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected
    close_and_check_workers(engine)


def test_idle_engine_keeps_its_workers(llama_dir, engines):
    """Workers wait for plans as long as the engine idles: before, an engine idle for longer than the collective
    timeout lost its workers (the wait for the next plan timed out)."""
    engine = engines(llama_dir, 2, tp_timeout_s=2.0)
    time.sleep(3.0)  # engine setup ended with a plan the worker received: it is waiting for the next one now
    results = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(results[0].token_ids) == 3
    close_and_check_workers(engine)


def test_failed_startup_leaves_no_worker_or_group_behind(tmp_path, engines):
    """One KV head cannot split over two ranks: every rank raises while sharding. The engine must reap its workers,
    leave the process group and remove its rendezvous directory, or the next engine could not start."""
    import glob
    import multiprocessing
    import tempfile

    import torch.distributed as dist

    from elastiserve.platforms import ConfigError

    config = transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    rendezvous = f"{tempfile.gettempdir()}/elastiserve-tp-*"
    before = set(glob.glob(rendezvous))
    with pytest.raises(ConfigError, match="do not split over tensor_parallel_size=2"):
        engines(write_model_dir(tmp_path, config, seed=0), 2)
    assert not dist.is_initialized() and not multiprocessing.active_children()
    assert set(glob.glob(rendezvous)) == before


def sample_everything(engine) -> list:
    """Seeded sampling with every penalty, sampled-token and prompt logprobs: tokens and every logprob, per prompt."""
    params = SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=8, ignore_eos=True, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.2, logprobs=2, prompt_logprobs=1)
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS):
        engine.add_request(request_id, prompt, params)
    got: dict[str, list] = {request_id: [[], [], []] for request_id in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, logprobs, prompt = got[out.request_id]
            tokens += out.new_token_ids
            logprobs += [(e.token_id, e.logprob, e.top) for e in out.logprobs or ()]
            prompt += [(e.token_id, e.logprob, e.top) for e in out.prompt_logprobs or ()]
    return [got[request_id] for request_id in ids]


def test_workers_get_the_forward_inputs_only_and_sampling_still_equals_tp1(llama_dir, engines, monkeypatch):
    """Rank 0 samples and scores alone, so the step plans it broadcasts carry no sampling params, request ids,
    penalty histories or prompt rows (``step_inputs.forward_inputs``); seeded sampling with penalties and logprobs
    gives what TP=1 gives."""
    from elastiserve.engine import tp

    expected = sample_everything(engines(llama_dir, 1))
    engine = engines(llama_dir, 2)
    plans = []
    broadcast = tp._broadcast
    monkeypatch.setattr(tp, "_broadcast", lambda group, plan: (plans.append(plan), broadcast(group, plan))[1])
    got = sample_everything(engine)
    runs = [plan.args[0] for plan in plans if plan.method == "run"]
    assert len(runs) >= 8 and all(run.tokens for run in runs)
    assert not any(run.sample_params or run.request_ids or run.sample_histories or run.sample_bans or run.prompt_rows
                   for run in runs)
    assert [tokens for tokens, _, _ in got] == [tokens for tokens, _, _ in expected]
    for (_, logprobs, prompt), (_, want_logprobs, want_prompt) in zip(got, expected):
        assert len(logprobs) == 8 and len(prompt) > 0
        for entry, want in zip(logprobs + prompt, want_logprobs + want_prompt):
            assert entry[0] == want[0] and [t for t, _ in entry[2]] == [t for t, _ in want[2]]
            # fp16 partial sums reduced over two ranks: close, not bit-equal (up to 7.5e-3 apart, measured here)
            assert entry[1] == pytest.approx(want[1], abs=2e-2)
    close_and_check_workers(engine)
