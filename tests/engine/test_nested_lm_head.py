"""A nested ``lm_head`` (``EngineConfig.nest_lm_head``, ``--nest-lm-head``): its planes merge back to the fp16 weight
bit for bit (a tied head gets planes of its own and leaves the embedding's table alone); it runs fast only with the
last decoder layer and then reads its upper plane only; its lower plane is part of the last layer's residual, so a
dps engine hands it to KV with that layer, restores it bit-exactly, and switches the head with the layers without
recomputing anything. With ``lm_head_exact_top`` the head reads its lower plane in fast mode for its top logits,
so the plane stays resident instead."""

from __future__ import annotations

import time

import pytest
import torch
from dense_context import dense_logits
from scripted_policies import EvictThenRestore
from tiny_models import random_fp16_model, tiny_llama_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams
from elastiserve.kernels import formats
from elastiserve.kernels.nested_linear import NestedLinear
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

LAYERS = 3  # tiny_llama_config's
SEQUENCES = [[int(t) for t in torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(n))] for n in (19, 6)]


def tiny_model(device, tied: bool):
    config = tiny_llama_config()
    config.tie_word_embeddings = tied
    return random_fp16_model(config, device=device.type, scale=0.15)


@pytest.mark.parametrize("policy", ["static-fp16", "elastickv"])
def test_a_policy_without_nested_weights_refuses_it(policy):
    with pytest.raises(ConfigError, match="nest_lm_head needs a policy with nested weights"):
        EngineConfig(model="x", policy=policy, nest_lm_head=True)
    assert EngineConfig(model="x", policy="dps", nest_lm_head=True).nest_lm_head


@pytest.mark.parametrize("tied", [False, True])
def test_planes_merge_back_and_the_head_follows_the_last_layer(device, tied):
    from elastiserve.engine.nested_weights import nest_weights, set_layer_modes

    plain = tiny_model(device, tied)
    model = tiny_model(device, tied)
    head_weight = model.lm_head.weight.detach().clone()
    embedding = model.embed_tokens.weight.detach().clone()
    nest_weights(plain)  # lm_head stays an fp16 linear: the reference for everything the head changes
    report = nest_weights(model, lm_head=True)
    head = model.lm_head
    assert type(plain.lm_head) is not NestedLinear and isinstance(head, NestedLinear) and head.is_nested
    assert report.layers["lm_head"][0] is head.nesting
    merged = formats.merge(head.upper, head.lower, head.nesting, head.weight_exp)
    assert torch.equal(merged.view(torch.int16), head_weight.view(torch.int16))
    assert torch.equal(model.embed_tokens.weight.view(torch.int16), embedding.view(torch.int16))  # tied: untouched

    # Full mode: both heads multiply the same fp16 weights with fp32 sums (rounding of the GEMMs' order only).
    full = dense_logits(model, SEQUENCES, device)
    torch.testing.assert_close(full, dense_logits(plain, SEQUENCES, device), atol=2e-3, rtol=0)
    for fast in (frozenset({0, 1}), frozenset({1, 2}), frozenset(range(LAYERS))):
        set_layer_modes(model, fast)
        assert head.fast == (LAYERS - 1 in fast), fast
    set_layer_modes(plain, frozenset(range(LAYERS)))
    fast_plain_head = dense_logits(plain, SEQUENCES, device)
    fast = dense_logits(model, SEQUENCES, device)
    moved = (fast - fast_plain_head).abs().max().item()
    # FP8 logits: moved, not lost (on the CPU 0.023-0.026 of logits up to 0.78, 92 % of the argmaxes kept; a GPU
    # quantizes the activations too, from 2 rows)
    assert 1e-3 < moved < 0.1 * fast_plain_head.abs().max().item()
    assert (fast.argmax(-1) == fast_plain_head.argmax(-1)).float().mean().item() >= 0.8
    head.lower.copy_(torch.randint(0, 256, head.lower.shape, generator=torch.Generator().manual_seed(3),
                                   dtype=torch.uint8).to(head.lower.device))
    assert torch.equal(dense_logits(model, SEQUENCES, device), fast)  # fast mode never reads the lower plane
    set_layer_modes(model, frozenset())
    assert not head.fast


def test_a_dps_engine_lends_the_heads_lower_plane_to_kv_with_the_last_layer_and_restores_it(device):
    block = 4 if device.type == "cpu" else 16
    block_bytes = LAYERS * 2 * 2 * block * 16 * 2
    options = dict(model="tiny", device=device.type, policy="dps", block_size=block, max_num_batched_tokens=16,
                   max_num_seqs=4, kv_cache_budget=96 * block_bytes, sink_pairs=1, recent_pairs=1)
    reference = LLMEngine(EngineConfig(**options), model=tiny_model(device, False), eos_token_ids=())
    engine = LLMEngine(EngineConfig(**options, nest_lm_head=True), model=tiny_model(device, False),
                       policy=EvictThenRestore(evict_at=3, restore_from=5), eos_token_ids=())
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        expected = reference.generate([SEQUENCES[0]], params)[0].token_ids
        head = engine.model.lm_head
        assert isinstance(head, NestedLinear) and head.is_nested
        lower_before = head.lower.clone()
        from elastiserve.engine.nested_weights import layer_lower_planes

        residuals = layer_lower_planes(engine.model)
        assert residuals[LAYERS - 1][-1] is head and all(head not in residuals[i] for i in range(LAYERS - 1))
        head_weight = tiny_model(device, False).lm_head.weight.detach()
        engine.add_request("r", SEQUENCES[0], params)
        seq = engine.scheduler.find("r")
        for _ in range(3):
            engine.step()
        assert engine.runner.fast_layers == frozenset(range(LAYERS)) and head.fast
        pool = engine.kv.pool  # KV takes every free block, the evicted residual units among them
        blocks = pool.allocate(pool.num_free(False), False)
        engine.runner.kv_cache[blocks] = torch.randn_like(engine.runner.kv_cache[blocks])
        pool.free(blocks)
        assert not torch.equal(head.lower, lower_before), "the head's residual units are dual-mapped into KV"
        for _ in range(400):
            engine.step()
            if not engine.runner.fast_layers:
                break
            time.sleep(0.005)
        assert engine.runner.fast_layers == frozenset() and not head.fast
        assert torch.equal(head.lower, lower_before)
        merged = formats.merge(head.upper, head.lower, head.nesting, head.weight_exp)
        assert torch.equal(merged.view(torch.int16), head_weight.view(torch.int16))
        while engine.has_unfinished():
            engine.step()
        assert seq.num_output_tokens == 12 and seq.metrics.preemptions == 0
        assert 0 < seq.metrics.fast_mode_tokens < 12
        assert seq.output_token_ids[:3] == expected[:3]  # before the switch: exact fp16 weights, head included
    finally:
        engine.close()
        reference.close()


def test_the_control_plane_sees_the_last_layers_residual_grown_by_the_head(device):
    """A head of 8,192 x 64 (512 KiB of lower plane; 65,536 x 64 on a GPU, whose units are 2 MiB) makes the last
    layer's residual span more VMM units than the others' (the CPU's units are 64 KiB): ``observe_step`` hands each
    layer's own units to the policies."""
    from elastiserve.engine.observe import observe_step

    config = tiny_llama_config()
    config.vocab_size = 8192 if device.type == "cpu" else 65536
    block = 4 if device.type == "cpu" else 16
    options = dict(model="tiny", device=device.type, policy="dps", block_size=block, max_num_batched_tokens=16,
                   max_num_seqs=4, kv_cache_budget=96 * LAYERS * 2 * 2 * block * 16 * 2, nest_lm_head=True)
    engine = LLMEngine(EngineConfig(**options), model=random_fp16_model(config, device=device.type, scale=0.15),
                       eos_token_ids=())
    try:
        obs = observe_step(0, engine.kv, engine.scheduler, engine.runner, None)
        first, *_, last = obs.layer_units
        assert len(obs.layer_units) == LAYERS and last > first == obs.units_per_layer
        assert obs.units_of(LAYERS - 1) == last
    finally:
        engine.close()


def test_exact_top_needs_a_nested_head_and_a_count():
    with pytest.raises(ConfigError, match="lm_head_exact_top needs nest_lm_head"):
        EngineConfig(model="x", policy="dps", lm_head_exact_top=8)
    with pytest.raises(ConfigError, match="lm_head_exact_top=-1"):
        EngineConfig(model="x", policy="dps", nest_lm_head=True, lm_head_exact_top=-1)


def test_a_head_with_exact_top_logits_keeps_its_lower_plane_while_the_layers_lend_theirs(device):
    """``lm_head_exact_top``: fast mode reads the head's lower plane for its top rows, so the plane is not part of
    the last layer's residual; KV written over every free block (the evicted units among them) leaves it intact,
    and the request that ran through eviction and restore finishes without recompute."""
    from elastiserve.engine.nested_weights import layer_lower_planes

    block = 4 if device.type == "cpu" else 16
    options = dict(model="tiny", device=device.type, policy="dps", block_size=block, max_num_batched_tokens=16,
                   max_num_seqs=4, kv_cache_budget=96 * LAYERS * 2 * 2 * block * 16 * 2, sink_pairs=1, recent_pairs=1,
                   nest_lm_head=True, lm_head_exact_top=4)
    engine = LLMEngine(EngineConfig(**options), model=tiny_model(device, False),
                       policy=EvictThenRestore(evict_at=3, restore_from=5), eos_token_ids=())
    try:
        head = engine.model.lm_head
        assert isinstance(head, NestedLinear) and head.is_nested and head.exact_top == 4
        residuals = layer_lower_planes(engine.model)
        assert all(head not in mods for mods in residuals.values()) and residuals[LAYERS - 1]
        lower_before = head.lower.clone()
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        engine.add_request("r", SEQUENCES[0], params)
        seq = engine.scheduler.find("r")
        for _ in range(3):
            engine.step()
        assert engine.runner.fast_layers == frozenset(range(LAYERS)) and head.fast
        pool = engine.kv.pool
        blocks = pool.allocate(pool.num_free(False), False)
        engine.runner.kv_cache[blocks] = torch.randn_like(engine.runner.kv_cache[blocks])
        pool.free(blocks)
        assert torch.equal(head.lower, lower_before), "the head's lower plane is not lent to KV"
        while engine.has_unfinished():
            engine.step()
            time.sleep(0.002)
        assert seq.num_output_tokens == 12 and seq.metrics.preemptions == 0 and seq.metrics.fast_mode_tokens > 0
        assert torch.equal(head.lower, lower_before)
    finally:
        engine.close()
