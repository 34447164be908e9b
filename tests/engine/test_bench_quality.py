"""Quality benchmark pieces: the BASE-pair mask (sinks, recent pairs, exposure cap) on hand-worked positions, the
BASE/FP8 attention contexts against plain attention over rounded K/V, per-channel FP8 weight rounding bounds, the
truncated ShareGPT reader, and a short SmolLM2 run over every variant (full mode must match fp16)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from elastiserve.engine.bench import quality as q
from elastiserve.kernels.kv_ops import e5m2_round

pytestmark = [pytest.mark.cpu]


def test_base_mask_hand_worked():
    # block 2 -> pairs of 4 tokens; 1 sink pair, 1 recent pair.
    full = q.base_mask(20, 2, 1, 1, 1.0)
    assert full[19].nonzero().flatten().tolist() == list(range(4, 16))  # 5 visible pairs: pairs 1..3 are BASE
    assert not full[7].any()  # 2 visible pairs: one sink, one recent
    assert full[11].nonzero().flatten().tolist() == [4, 5, 6, 7]  # 3 visible pairs: pair 1 only
    capped = q.base_mask(20, 2, 1, 1, 0.25)
    assert capped[19].nonzero().flatten().tolist() == [4, 5, 6, 7]  # floor(0.25 * 20 / 4) = 1 pair
    assert not torch.triu(full, diagonal=1).any()  # never a future key


def test_measured_exposure_respects_caps():
    cfg = q.QualityConfig(block_size=4)  # 8-token pairs: a 5 % cap already allows BASE pairs at 160 tokens
    seqs = [[0] * 256, [0] * 200]
    exposures = [q.measured_exposure(seqs, cfg, cap) for cap in (0.05, 0.1, 0.2, 1.0)]
    assert exposures == sorted(exposures) and exposures[0] > 0
    for cap, exp in zip((0.05, 0.1, 0.2), exposures):
        assert exp <= cap
    assert exposures[-1] < 1.0  # sinks and recent pairs stay TARGET


def _qkv(n=37, hq=6, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=g).to(torch.float16) for h in (hq, hkv, hkv)]


def _sdpa(qx, k, v):
    group = qx.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(qx.transpose(0, 1).float(),
                                         k.transpose(0, 1).float().repeat_interleave(group, 0),
                                         v.transpose(0, 1).float().repeat_interleave(group, 0), is_causal=True)
    return out.transpose(0, 1)


def test_base_context_matches_rounded_attention():
    qx, k, v = _qkv()
    n = qx.shape[0]
    none = q.QualityContext("base", torch.zeros(n, n, dtype=torch.bool)).attend(0, qx, k, v)
    torch.testing.assert_close(none.float(), _sdpa(qx, k, v), atol=2e-3, rtol=0)
    all_base = q.QualityContext("base", torch.ones(n, n, dtype=torch.bool).tril()).attend(0, qx, k, v)
    torch.testing.assert_close(all_base.float(), _sdpa(qx, e5m2_round(k), e5m2_round(v)), atol=2e-3, rtol=0)
    assert (all_base - none).abs().max() > 1e-3  # E5M2 rounding is visible


def test_fp8_kv_context_and_weight_rounding():
    qx, k, v = _qkv(seed=1)
    out = q.QualityContext("fp8").attend(0, qx, k, v)
    torch.testing.assert_close(out.float(), _sdpa(qx, q.fp8_e4m3_round(k), q.fp8_e4m3_round(v)), atol=2e-3, rtol=0)
    assert q.fp8_e4m3_round(torch.tensor([1000.0, 0.3125], dtype=torch.float16)).tolist() == [448.0, 0.3125]

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder_layers = torch.nn.ModuleList([torch.nn.Linear(33, 17).half()])
            self.lm_head = torch.nn.Linear(33, 5).half()

    model = Tiny()
    before = model.decoder_layers[0].weight.detach().float().clone()
    head = model.lm_head.weight.detach().clone()
    assert q.fp8_weights_(model) == 1
    after = model.decoder_layers[0].weight.float()
    row_max = before.abs().amax(dim=1, keepdim=True)
    # E4M3 keeps 3 mantissa bits: error <= 2^-4 relative to the element, so <= row amax / 16.
    assert ((after - before).abs() <= row_max / 16 + 1e-4).all()
    assert (after - before).abs().max() > 0 and torch.equal(model.lm_head.weight, head)


def test_fast_weights_of_a_tied_lm_head_leave_the_embedding_alone():
    class TiedTiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder_layers = torch.nn.ModuleList([torch.nn.Linear(33, 17).half()])
            self.embed_tokens = torch.nn.Embedding(5, 33).half()
            self.lm_head = torch.nn.Linear(33, 5, bias=False).half()
            self.lm_head.weight = self.embed_tokens.weight

    torch.manual_seed(0)
    model = TiedTiny()
    table = model.embed_tokens.weight.detach().clone()
    assert q.nested_weights_(model, "fast", lm_head=True) == 2
    assert torch.equal(model.embed_tokens.weight, table) and model.lm_head.weight is not model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, table)  # the upper plane: 2 or 3 mantissa bits of 10 left
    assert ((model.lm_head.weight.float() - table.float()).abs() <= table.float().abs() / 8 + 2**-9).all()


def test_sharegpt_reader_and_exact_sequences():
    answers = q.sharegpt_answers()
    first = [next(answers) for _ in range(3)]
    assert all(isinstance(a, str) and a for a in first)

    class WordTokenizer:
        def encode(self, text):
            return [len(w) for w in text.split()]

    seqs = q.eval_sequences(WordTokenizer(), num_tokens=150, seq_len=64)
    assert [len(s) for s in seqs] == [64, 64, 22]


def test_quality_run_on_smollm2():
    # 2-token blocks (4-token pairs) so the caps bite within 64 tokens; one prompt, two generated tokens.
    cfg = q.QualityConfig(num_tokens=64, seq_len=64, block_size=2, prompts=q.DEFAULT_PROMPTS[:1], gen_tokens=2)
    report = q.run_quality(cfg)
    by = {r["name"]: r for r in report["results"]}
    assert list(by) == ["fp16", "base-5%", "base-10%", "base-20%", "base-100%", "fp8-kv", "fp8-weights", "full",
                        "fast", "fast-lm-head", "fast-lm-head-exact"]
    ref = by["fp16"]
    assert 1.0 < ref["perplexity"] < 100 and ref["tokens"] == 63
    assert by["full"]["top1_agreement"] >= 0.99 and by["full"]["generation_exact"] == 1.0
    assert math.isclose(by["full"]["perplexity"], ref["perplexity"], rel_tol=2e-3)
    assert by["fast-lm-head"]["perplexity"] != by["fast"]["perplexity"]  # the head's FP8 logits count
    # The exact top logits (16 a row) give back the argmaxes the FP8 head moved
    assert by["fast-lm-head-exact"]["top1_agreement"] >= by["fast-lm-head"]["top1_agreement"]
    for name in ("fast", "fast-lm-head", "fast-lm-head-exact", "fp8-weights", "fp8-kv", "base-100%"):
        assert 0.7 <= by[name]["top1_agreement"] <= 1.0, name
        assert math.isclose(by[name]["perplexity"], ref["perplexity"], rel_tol=0.25), name
    exposures = [by[f"base-{c}%"]["base_exposure"] for c in (5, 10, 20, 100)]
    assert exposures == sorted(exposures) and 0 < exposures[1] <= 0.1 and exposures[-1] > 0.3
    assert "ppl" in q.format_quality(report)
