"""Nested MoE experts in the runner (``engine/nested_weights.py``).

Before, nested-weight policies nested only ``nn.Linear`` modules: the stacked expert weights of a MoE model stayed
fp16, ran the same in fast mode and were missing from the layer's residual. Pinned here on a tiny random Qwen3-MoE:
- each stacked expert tensor gets one nesting (E4M3, E4M3 with a prescale, or E5M2) and its planes merge back to the
  fp16 weight bit for bit;
- full mode gives the unnested fp16 model's logits (to fp16 rounding), fast mode differs but stays close, and fast
  mode reads the upper planes only;
- in an engine with policy dps the layer's residual bytes include the experts' lower planes, evicting the residual
  lets KV overwrite them, and the restore brings them back bit-exactly while the run completes.
"""

from __future__ import annotations

import time

import pytest
import torch
import transformers
from dense_context import dense_logits
from scripted_policies import EvictThenRestore

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.models import build_model
from elastiserve.engine.sampling import SamplingParams
from elastiserve.kernels import formats
from elastiserve.kernels.formats import Nesting
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu]  # not yet run on a GPU

NUM_LAYERS = 2


@pytest.fixture(scope="module")
def tiny_moe():
    """A random Qwen3-MoE whose weights are exactly fp16; two expert tensors carry an outlier so that one nests as
    E4M3 with a prescale and one as E5M2."""
    config = transformers.Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=97, hidden_size=48, num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=80, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for param in hf.parameters():  # larger than the 0.02 init so the experts move the logits
            param.normal_(0.0, 0.2)
    state = {name: t.half() for name, t in hf.state_dict().items()}
    # transformers 5 names: the experts come stacked, down_proj [E, H, I] and gate_up_proj [E, 2I, H].
    # Layer 0's down experts: values below 2^-10 flushed, so scaling by 2^-2 is exact -> E4M3 with weight_exp 2.
    down = state["model.layers.0.mlp.experts.down_proj"]
    down[down.abs() < 2.0**-10] = 0.0
    down[2, 0, 1] = 5.0
    state["model.layers.1.mlp.experts.gate_up_proj"][4, 3, 0] = -40.0  # beyond the E4M3 prescales -> E5M2
    return config.to_dict(), state


def build(tiny_moe, device):
    hf_config, state = tiny_moe
    model = build_model(hf_config, dtype=torch.float16, device=device)
    model.load_weights(state.items())
    return model


def nested_model(tiny_moe, device):
    from elastiserve.engine.nested_weights import nest_weights

    model = build(tiny_moe, device)
    return model, nest_weights(model)


def experts_of(model):
    from elastiserve.engine.nested_weights import NestedExperts

    return {name: m for name, m in model.named_modules() if isinstance(m, NestedExperts)}


SEQUENCES = [[int(t) for t in torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n))] for n in (23, 7)]


def logits_of(model, device) -> torch.Tensor:
    return dense_logits(model, SEQUENCES, device)


def test_expert_planes_merge_back_bit_exactly(tiny_moe, device):
    reference = build(tiny_moe, device)
    model, report = nested_model(tiny_moe, device)
    experts = experts_of(model)
    names = [f"decoder_layers.{i}.mlp.{w}" for i in range(NUM_LAYERS) for w in ("w_down", "w_gate_up")]
    assert sorted(experts) == names
    kinds = {name: (m.nesting, m.weight_exp) for name, m in experts.items()}
    assert kinds["decoder_layers.0.mlp.w_down"] == (Nesting.E4M3, 2)
    assert kinds["decoder_layers.1.mlp.w_gate_up"] == (Nesting.E5M2, 0)
    assert kinds["decoder_layers.0.mlp.w_gate_up"] == (Nesting.E4M3, 0)
    assert report.weight_exps == {"decoder_layers.0.mlp.w_down": 2}
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    assert len(routers) == NUM_LAYERS and all(type(m) is torch.nn.Linear for m in routers)  # routers stay 16-bit
    for name, m in experts.items():
        assert report.layers[name][0] is m.nesting
        original = reference.get_parameter(name)
        assert m.shape == original.shape and not any(n.endswith(name) for n, _ in model.named_parameters())
        merged = formats.merge(m.upper, m.lower, m.nesting, m.weight_exp)
        assert torch.equal(merged.view(torch.int16), original.view(torch.int16)), name


def test_full_mode_matches_fp16_and_fast_mode_stays_close(tiny_moe, device):
    from elastiserve.engine.nested_weights import set_layer_modes

    expected = logits_of(build(tiny_moe, device), device)
    model, _ = nested_model(tiny_moe, device)
    full = logits_of(model, device)
    # Both sides multiply the same fp16 weights with fp32 sums: only the fp16 rounding of intermediates differs
    # (measured 5e-4 on the CPU, logits up to 1.1; fast mode is 0.04 away, so this bound tells the modes apart).
    torch.testing.assert_close(full, expected, atol=2e-3, rtol=0)
    set_layer_modes(model, frozenset(range(NUM_LAYERS)))
    assert all(m.fast for m in experts_of(model).values())
    fast = logits_of(model, device)
    error = (fast - expected).abs().max().item()
    assert 5e-3 < error < 0.15 * expected.abs().max().item()
    assert (fast.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.85
    set_layer_modes(model, frozenset())
    assert torch.equal(logits_of(model, device), full)


def test_fast_mode_reads_upper_planes_only(tiny_moe, device):
    from elastiserve.engine.nested_weights import set_layer_modes

    model, _ = nested_model(tiny_moe, device)
    set_layer_modes(model, frozenset({1}))  # layer 0 full, layer 1 fast
    before = logits_of(model, device)
    experts = experts_of(model)
    generator = torch.Generator().manual_seed(5)
    garbage = {name: torch.randint(0, 256, m.lower.shape, generator=generator, dtype=torch.uint8)
               for name, m in experts.items()}  # fmt: skip
    for name, m in experts.items():
        if name.startswith("decoder_layers.1."):
            m.lower.copy_(garbage[name])
    assert torch.equal(logits_of(model, device), before)  # the fast layer never read its experts' lower bytes
    experts["decoder_layers.0.mlp.w_down"].lower.copy_(garbage["decoder_layers.0.mlp.w_down"])
    assert not torch.equal(logits_of(model, device), before)  # while the full layer does


def test_bind_lower_refuses_a_misfit_plane(tiny_moe, device):
    model, _ = nested_model(tiny_moe, device)
    m = experts_of(model)["decoder_layers.0.mlp.w_gate_up"]
    with pytest.raises(ConfigError, match="lower plane"):
        m.bind_lower(torch.zeros(m.upper.numel() - 1, dtype=torch.uint8, device=m.upper.device))
    with pytest.raises(ConfigError, match="lower plane"):
        m.bind_lower(torch.zeros(m.upper.shape, dtype=torch.float16, device=m.upper.device))


def kv_block_bytes(block: int) -> int:
    return NUM_LAYERS * 2 * 2 * block * 16 * 2  # layers * (k|v) * kv heads * block * head_dim * fp16


def test_dps_engine_evicts_and_restores_expert_residuals(tiny_moe, device):
    from elastiserve.engine.nested_weights import layer_lower_planes

    block = 4 if device.type == "cpu" else 16
    config = EngineConfig(
        model="tiny-qwen3-moe", device=device.type, block_size=block, max_num_batched_tokens=16, max_num_seqs=4,
        kv_cache_budget=96 * kv_block_bytes(block), enforce_eager=False, policy="dps",
    )  # fmt: skip
    engine = LLMEngine(config, model=build(tiny_moe, device), policy=EvictThenRestore(evict_at=3, restore_from=5),
                       eos_token_ids=())  # fmt: skip
    experts = experts_of(engine.model)
    manager = engine.runner.pool.manager
    for layer, mods in layer_lower_planes(engine.model).items():
        expert_bytes = sum(m.upper.numel() for m in mods if m in experts.values())
        linear_bytes = sum(m.upper.numel() for m in mods if m not in experts.values())
        assert expert_bytes > 0 and linear_bytes > 0
        assert manager.residual_view(layer).numel() == expert_bytes + linear_bytes
    lower_before = {name: m.lower.clone() for name, m in experts.items()}
    engine.add_request("r", SEQUENCES[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    seq = engine.scheduler.find("r")
    for _ in range(3):
        engine.step()
    assert engine.runner.fast_layers == frozenset(range(NUM_LAYERS))
    assert all(m.fast for m in experts.values())
    pool = engine.kv.pool  # use the reclaimed units as KV would: the evicted expert bytes get overwritten
    blocks = pool.allocate(pool.num_free(False), False)
    engine.runner.kv_cache[blocks] = torch.randn_like(engine.runner.kv_cache[blocks])
    pool.free(blocks)
    assert all(not torch.equal(m.lower, lower_before[name]) for name, m in experts.items())
    for _ in range(400):
        engine.step()
        if not engine.runner.fast_layers:
            break
        time.sleep(0.005)  # the restore worker copies on its own thread
    assert engine.runner.fast_layers == frozenset() and not any(m.fast for m in experts.values())
    for name, m in experts.items():
        assert torch.equal(m.lower, lower_before[name]), name
    while engine.has_unfinished():
        engine.step()
    assert seq.num_output_tokens == 12 and seq.metrics.preemptions == 0
    assert 0 < seq.metrics.fast_mode_tokens < 12
    assert all(0 <= t < 97 for t in seq.output_token_ids)
    engine.close()
