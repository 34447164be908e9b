"""Running the lines of ``elastiserve generate`` (read by ``generate_input``) on an engine, as vLLM's offline
``LLM.generate`` runs a list of prompts: every request is added before the first step (a line the model refuses stops
the command before any generation), then the engine steps until all have finished and one JSON row a line is written.

A line with ``n`` > 1 runs ``n`` engine requests (seeds ``seed``, ``seed + 1``, ... when the line gives a seed, as the
server's choices do) and its row holds ``choices``; ``best_of`` > ``n`` runs that many candidates, scores each by
the mean log-probability of its sampled tokens and keeps the ``n`` best, best first, as the server does. A line with
``n`` = 1 keeps the flat row: ``text``, ``token_ids``, ``finish_reason`` (and ``logprobs`` when asked)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from elastiserve.engine.errors import InvalidRequest
from elastiserve.engine.generate_input import GenerateLine
from elastiserve.engine.request_fields import BadRequest
from elastiserve.engine.sampling import best_candidates, choice_params
from elastiserve.platforms.errors import ConfigError


@dataclasses.dataclass(slots=True)
class _Candidate:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[list] = dataclasses.field(default_factory=list)  # [token id, logprob, [[id, logprob], ...]]
    finish_reason: str | None = None

    @property
    def mean_logprob(self) -> float:
        """Per sampled token; an empty candidate ranks last, as on the server (``RequestRun.mean_logprob``)."""
        return sum(entry[1] for entry in self.logprobs) / len(self.logprobs) if self.logprobs else float("-inf")


def candidate_ids(index: int, best_of: int) -> list[str]:
    """The engine request ids of line ``index``'s candidates: the index itself for a lone one."""
    return [str(index)] if best_of == 1 else [f"{index}-{j}" for j in range(best_of)]


def prompt_ids(engine: Any, line: GenerateLine) -> list[int]:
    """A line's prompt as token ids (text and chats through the model's tokenizer and chat template)."""
    if isinstance(line.prompt, list) and not line.is_chat:
        return list(line.prompt)
    if engine.tokenizer is None:
        raise ConfigError("the model has no tokenizer: give 'prompt_token_ids'")
    text = engine.tokenizer.apply_chat_template(line.prompt) if line.is_chat else line.prompt
    return list(engine.tokenizer.encode(text))


def run_generate(engine: Any, lines: list[GenerateLine], input_name: str, output: Path) -> int:
    """Add every line's candidates, step the engine until all finish, write ``output``; returns the rows written."""
    from tqdm import tqdm

    candidates: dict[str, _Candidate] = {}
    for i, line in enumerate(lines):  # nothing runs before every request is in: a refusal costs no generation
        params = line.params
        if line.best_of > line.n and params.logprobs is None:  # score the sampled tokens only (no alternatives)
            params = dataclasses.replace(params, logprobs=0)
        names = candidate_ids(i, line.best_of)
        try:
            ids = prompt_ids(engine, line)
            for j, name in enumerate(names):
                engine.add_request(name, ids, choice_params(params, j), prefix_leader=None if j == 0 else names[0])
                candidates[name] = _Candidate()
        except (InvalidRequest, BadRequest, ConfigError) as exc:  # too long for the model, a template error...
            raise ConfigError(f"{input_name} line {line.lineno}: {exc}") from None
    with tqdm(total=len(candidates), desc="generate") as bar:
        while engine.has_unfinished():
            for out in engine.step():
                candidate = candidates[out.request_id]
                candidate.token_ids.extend(out.new_token_ids)
                candidate.logprobs += [[e.token_id, e.logprob, [list(t) for t in e.top]] for e in out.logprobs or []]
                if out.finished:
                    candidate.finish_reason = out.finish_reason
                    bar.update(1)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w") as f:
        for i, line in enumerate(lines):
            f.write(json.dumps(_row(engine, i, line, [candidates[name] for name in candidate_ids(i, line.best_of)]))
                    + "\n")
    return len(lines)


def _row(engine: Any, index: int, line: GenerateLine, group: list[_Candidate]) -> dict[str, Any]:
    if line.best_of > line.n:  # the n of the highest mean log-probability per token, best first
        group = [group[k] for k in best_candidates(group, line.n)]
    choices = [_choice(engine, line, candidate) for candidate in group]
    if line.n == 1:
        return {"index": index, "input": line.record, **choices[0]}
    return {"index": index, "input": line.record, "choices": [{"index": k, **c} for k, c in enumerate(choices)]}


def _choice(engine: Any, line: GenerateLine, candidate: _Candidate) -> dict[str, Any]:
    text = engine.tokenizer.decode(candidate.token_ids) if engine.tokenizer is not None else None
    choice = {"text": text, "token_ids": candidate.token_ids, "finish_reason": candidate.finish_reason}
    if line.params.logprobs is not None:  # asked for by the line or the flags, not only drawn to rank candidates
        choice["logprobs"] = candidate.logprobs
    return choice
