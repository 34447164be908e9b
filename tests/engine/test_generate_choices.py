"""``elastiserve generate`` with ``n`` and ``best_of`` on SmolLM2 (CPU): a line's ``n`` choices draw from seeds
``seed``, ``seed + 1``, ... (so each replays alone), its row holds ``choices``; ``best_of`` keeps the ``n`` candidates
of the highest mean log-probability, best first, and shows no log-probabilities unless the line asked for them."""

from __future__ import annotations

import json

import pytest

from elastiserve.engine import cli

pytestmark = [pytest.mark.cpu]

PROMPT = "Once upon a time"


def _mean(choice: dict) -> float:
    return sum(entry[1] for entry in choice["logprobs"]) / len(choice["logprobs"])


def test_choices_replay_from_their_seeds_and_best_of_keeps_the_best(tmp_path):
    sampled = {"prompt": PROMPT, "temperature": 1.0, "max_tokens": 5}
    lines = [
        {**sampled, "n": 3, "seed": 7},
        {**sampled, "seed": 8},  # choice 1 of the line above, alone
        {**sampled, "n": 4, "seed": 3, "logprobs": 0},  # every candidate of the two lines below, scored
        {**sampled, "n": 2, "best_of": 4, "seed": 3, "logprobs": 0},
        {**sampled, "best_of": 4, "seed": 3, "tag": "best"},
    ]
    prompts, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["generate", "smollm2", "--device", "cpu", "--max-model-len", "128", "--input", str(prompts),
            "--output", str(out)]
    assert cli.main(argv) == 0
    three, alone, every, two_best, best = [json.loads(row) for row in out.read_text().splitlines()]

    assert "text" not in three and [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 5 and c["text"] for c in three["choices"])
    assert len({tuple(c["token_ids"]) for c in three["choices"]}) > 1, "the choices share one seed"
    assert three["choices"][1]["token_ids"] == alone["token_ids"]

    ranked = sorted(every["choices"], key=lambda c: -_mean(c))
    assert [c["token_ids"] for c in two_best["choices"]] == [c["token_ids"] for c in ranked[:2]]
    assert _mean(two_best["choices"][0]) >= _mean(two_best["choices"][1])
    assert best["token_ids"] == ranked[0]["token_ids"] and best["input"]["tag"] == "best"
    assert "logprobs" not in best and "choices" not in best  # scored to rank, not asked for; n = 1 stays flat


def test_an_empty_candidate_ranks_last_as_on_the_server():
    """A candidate that sampled nothing (stopped at once) has no score: it must not outrank scored ones (a mean over
    no tokens read as 0 would have ranked it first)."""
    from types import SimpleNamespace

    from elastiserve.engine.generate_run import _Candidate, _row
    from elastiserve.engine.sampling import SamplingParams

    empty = _Candidate(finish_reason="stop")
    worse = _Candidate([5, 6], [[5, -2.0, []], [6, -2.0, []]], "length")
    better = _Candidate([7], [[7, -0.5, []]], "length")
    line = SimpleNamespace(n=2, best_of=3, record={}, params=SamplingParams(temperature=1.0))
    row = _row(SimpleNamespace(tokenizer=None), 0, line, [empty, worse, better])
    assert [c["token_ids"] for c in row["choices"]] == [[7], [5, 6]]
