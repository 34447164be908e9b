"""Pins the Sampler: greedy is argmax; top-k / top-p masks keep exactly the right tokens; seeded rows reproduce
and do not depend on their batch neighbours; sampled frequencies follow softmax(logits / T) within ~4 sigma.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from elastiserve.engine.sampler import (
    PenaltyHistory,
    Sampler,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    penalize,
    sampling_probs,
)

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


@dataclass
class Params:  # the fields of SamplingParams the sampler reads
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple = ()


def random_logits(rows: int, vocab: int, seed: int, device, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale).to(device)


def test_greedy_is_argmax(device):
    logits = random_logits(7, 1031, 0, device)
    tokens = Sampler()(logits, [Params(temperature=0.0, top_k=5, top_p=0.5)] * 7)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_keeps_exactly_k_largest(device):
    logits = random_logits(4, 301, 1, device)
    ks = torch.tensor([1, 7, 0, 400], device=device)  # 0 and > V mean "no limit"
    masked = apply_top_k(logits, ks)
    for row, k in enumerate([1, 7, 301, 301]):
        kept = torch.isfinite(masked[row]).nonzero().flatten().sort().values
        assert torch.equal(kept, logits[row].topk(k).indices.sort().values)
        assert torch.equal(masked[row][kept], logits[row][kept])


def test_top_p_keeps_smallest_prefix_reaching_p(device):
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]], device=device)
    logits = probs.log()
    cases = {0.4: [1], 0.75: [1, 3], 0.9: [1, 2, 3], 0.99: [0, 1, 2, 3], 1.0: [0, 1, 2, 3], 0.01: [1]}
    for p, expected in cases.items():
        masked = apply_top_p(logits, torch.tensor([p], device=device))
        assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == expected, p


def test_min_p_keeps_tokens_at_least_min_p_of_the_most_likely(device):
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.25, 0.25]], device=device)
    cases = {0.0: [[0, 1, 2, 3], [0, 1, 2, 3]], 0.2: [[1, 2, 3], [0, 1, 2, 3]], 0.5: [[1, 3], [0, 1, 2, 3]],
             1.0: [[1], [0, 1, 2, 3]]}
    for p, expected in cases.items():
        masked = apply_min_p(probs.log(), torch.tensor([p, p], device=device))
        assert [torch.isfinite(row).nonzero().flatten().tolist() for row in masked] == expected, p
    logits = random_logits(64, 97, 5, device)
    params = [Params(min_p=0.3)] * 64
    tokens = Sampler()(logits, params)
    probs = torch.softmax(logits, dim=-1)
    chosen = probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert bool((chosen >= 0.3 * probs.max(dim=-1).values * (1 - 1e-5)).all())


def test_logit_bias_is_added_before_greedy_and_sampling(device):
    logits = random_logits(3, 50, 6, device)
    biased = apply_logit_bias(logits, [((4, 100.0), (4, -1.5)), (), ((0, -100.0), (7, 2.5))])
    expected = logits.clone()
    expected[0, 4] += 98.5  # repeated ids accumulate
    expected[2, 0] -= 100.0
    expected[2, 7] += 2.5
    torch.testing.assert_close(biased, expected)
    forced = Sampler()(logits, [Params(temperature=0.0, logit_bias=((13, 100.0),)), Params(logit_bias=((21, 100.0),)),
                                Params(temperature=0.0)])
    assert forced.tolist()[:2] == [13, 21] and forced[2] == logits[2].argmax()


def test_banned_tokens_are_never_picked(device):
    logits = random_logits(3, 40, 8, device)
    top = logits.argmax(-1).tolist()
    params = [Params(temperature=0.0), Params(temperature=0.0), Params(temperature=1.0, min_p=1.0)]
    tokens = Sampler()(logits, params, bans=[(top[0],), (), (top[2], 1)]).tolist()
    assert tokens[0] == logits[0].topk(2).indices[1] and tokens[1] == top[1]
    assert tokens[2] not in (top[2], 1)  # min_p 1 keeps the most likely token the ban left


def test_samples_stay_inside_top_k_and_top_p(device):
    logits = random_logits(1, 64, 2, device, scale=1.0).expand(4000, 64).contiguous()
    top_k_tokens = Sampler()(logits, [Params(temperature=1.5, top_k=3)] * 4000)
    assert set(top_k_tokens.tolist()) == set(logits[0].topk(3).indices.tolist())
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = order[: int((probs[order].cumsum(0) < 0.6).sum()) + 1]
    top_p_tokens = Sampler()(logits, [Params(temperature=1.0, top_p=0.6)] * 4000)
    assert len(nucleus) > 3  # a real nucleus, not just the top token
    assert set(top_p_tokens.tolist()) == set(nucleus.tolist())


def test_seeded_rows_reproduce_and_ignore_batch_neighbours(device):
    logits = random_logits(3, 500, 3, device)
    params = [Params(temperature=1.0)] * 3

    def draw(batch_rows, seed_of_row0):
        generators = {0: torch.Generator(device=device).manual_seed(seed_of_row0)}
        return Sampler()(logits[batch_rows], params[: len(batch_rows)], generators)[0].item()

    runs = [[draw([0, 1, 2], seed), draw([0], seed), draw([0, 2], seed)] for seed in range(20)]
    assert all(len(set(run)) == 1 for run in runs)  # same seed: same token, whatever else is in the batch
    assert len({run[0] for run in runs}) > 3  # different seeds: different tokens (entropy is high here)


def test_temperature_frequencies_follow_softmax(device):
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], device=device)
    draws = 20000
    for temperature in (0.5, 2.0):
        generator = torch.Generator(device=device).manual_seed(11)
        tokens = Sampler()(
            base.expand(draws, 5).contiguous(), [Params(temperature=temperature)] * draws, [generator] * draws
        )
        frequency = torch.bincount(tokens.cpu(), minlength=5).float() / draws
        expected = torch.softmax(base.cpu() / temperature, -1)
        sigma = (expected * (1 - expected) / draws).sqrt()
        # 4.5 sigma per entry; T=0.5 vs T=2 differ by > 0.2 in the first entry, so ignoring T fails here.
        assert ((frequency - expected).abs() <= 4.5 * sigma + 1e-4).all(), (temperature, frequency, expected)


def test_sampling_probs_combine_temperature_top_k_top_p(device):
    logits = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.1)]], device=device)
    probs = sampling_probs(logits, temperatures=[1.0], top_ks=[2], top_ps=[1.0])
    torch.testing.assert_close(probs.cpu(), torch.tensor([[2 / 3, 1 / 3, 0.0]]))
    probs = sampling_probs(logits, temperatures=[1.0], top_ks=[-1], top_ps=[0.5])
    torch.testing.assert_close(probs.cpu(), torch.tensor([[1.0, 0.0, 0.0]]))


def test_mismatched_params_raise(device):
    with pytest.raises(ValueError, match="sampling params"):
        Sampler()(random_logits(2, 5, 0, device), [Params()])


@dataclass
class PenaltyParams(Params):
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


def test_penalties_match_hand_computed_logits(device):
    """Row 0: prompt [1], generated [3, 3, 2]; repetition 2 divides positive and multiplies negative logits of tokens
    1, 2, 3; frequency 0.5 takes 2 x 0.5 from token 3 and 0.5 from token 2; presence 0.25 takes 0.25 from both.
    Row 1 has no history and stays as it was."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]], device=device)
    params = [PenaltyParams(temperature=0.0, presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=2.0),
              PenaltyParams(temperature=0.0)]
    out = apply_penalties(logits, params, [([1], [3, 3, 2]), None])
    expected = torch.tensor([[2.0, -2.0, -0.5, 0.25], [2.0, -1.0, 0.5, 3.0]], device=device)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    history = PenaltyHistory("r", [1, 3, 3, 2], 1, [3, 3, 2])
    assert Sampler()(logits, params, histories=[history, None]).tolist() == [0, 3]  # greedy too
    assert logits[0, 3] == 3.0  # the input is not modified


def test_penalties_only_on_generated_tokens_for_openai_fields(device):
    logits = torch.zeros(1, 5, device=device)
    params = [PenaltyParams(frequency_penalty=1.0, presence_penalty=1.0)]
    out = apply_penalties(logits, params, [([0, 1, 1], [4])])  # prompt tokens are not penalised by these two
    assert out.tolist() == [[0.0, 0.0, 0.0, 0.0, -2.0]]


def test_persistent_penalty_counts_equal_the_reference_step_by_step(device):
    """The sampler keeps each request's counts between steps and adds only the new tokens; over steps where rows
    join, grow, leave (their slot reused by a newcomer) and outnumber the first allocation (8 slots), the
    penalised logits equal the stateless reference's, bit for bit."""
    vocab = 11
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler()
    outputs: dict[str, list[int]] = {}
    prompts = {f"r{i}": [int(t) for t in torch.randint(0, vocab, (3 + i,), generator=gen)] for i in range(14)}
    params = {rid: PenaltyParams(temperature=0.0, presence_penalty=0.3, frequency_penalty=0.2,
                                 repetition_penalty=1.0 if i % 3 else 1.7) for i, rid in enumerate(prompts)}
    schedule = [["r0", "r1"], ["r0", "r1", "r2"], *[[f"r{i}" for i in range(1, 12)]] * 3, ["r12", "r13", "r5"]]
    for step, ids in enumerate(schedule):
        if step == len(schedule) - 1:
            for rid in ("r0", "r1", "r2"):  # finished: their slots go to r12 and r13
                sampler.release(rid)
        for rid in ids:
            outputs.setdefault(rid, [])
        logits = torch.randn(len(ids), vocab, generator=gen).to(device)
        rows = [params[rid] for rid in ids]
        histories = [PenaltyHistory(rid, prompts[rid] + outputs[rid], len(prompts[rid]), outputs[rid]) for rid in ids]
        with_prompt = any(p.repetition_penalty != 1.0 for p in rows)
        generated, in_prompt = sampler.penalty_counts.gather(histories, with_prompt, vocab, logits.device)
        ours = penalize(logits, rows, list(range(len(ids))), generated, in_prompt)
        reference = apply_penalties(logits, rows, [(prompts[rid], outputs[rid]) for rid in ids])
        assert torch.equal(ours, reference), step
        for rid, token in zip(ids, ours.argmax(dim=-1).tolist()):
            outputs[rid].append(token)
    assert sampler.penalty_counts.capacity == 16  # grown once past 8 slots


@pytest.mark.parametrize(("params", "message"), [
    ({"temperature": math.nan}, "temperature"),
    ({"top_k": 2**63}, "top_k"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
])
def test_parameters_a_step_cannot_hold_are_refused_before_admission(params, message):
    """A NaN temperature, or a top_k / seed past int64 (which the step's tensors and generator hold), is the
    request's error, not a failed step for every request in its batch."""
    from elastiserve.engine.errors import InvalidRequest
    from elastiserve.engine.sampling import SamplingParams

    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**params).validate(vocab_size=100, max_model_len=64, prompt_len=4)
    SamplingParams(top_k=2**63 - 1, seed=-(2**63)).validate(vocab_size=100, max_model_len=64, prompt_len=4)
