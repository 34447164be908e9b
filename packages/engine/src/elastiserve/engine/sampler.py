"""Token sampling: penalties, logit bias, greedy, temperature, min-p, top-k, top-p, and per-request seeds.

Penalties apply to the logits first, greedy rows included, with vLLM's semantics: ``repetition_penalty`` (HF's
CTRL-style rule: a positive logit divided by it, a negative one multiplied) over the prompt and generated tokens;
OpenAI's ``frequency_penalty`` (times the count) and ``presence_penalty`` (once) over the generated tokens only.

OpenAI's ``logit_bias`` is added next, before the argmax, so it steers greedy rows too; then a guided row's mask of
allowed tokens (structured output, ``elastiserve.engine.guided``) sets every other token to -inf, so top-k, top-p and
min-p act on the constrained distribution. Rows with temperature 0 take
the argmax. The others are scaled, masked by min-p (vLLM's: tokens less likely than min_p x the most likely one),
then top-k, then top-p (all on the temperature-scaled distribution, the order vLLM uses), and drawn with the
exponential-race trick (argmax of p / Exp(1) noise), which samples from p exactly and needs one random draw per
vocabulary entry.
A row whose params carry a seed draws its noise from its own torch.Generator, so its tokens do not depend on what
else is in the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

_GREEDY_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class PenaltyHistory:
    """A penalised row's tokens, by reference (nothing is copied per step): ``token_ids[:num_prompt]`` is the prompt,
    ``output_ids`` what the request has generated so far (it only grows)."""

    request_id: str
    token_ids: Sequence[int]
    num_prompt: int
    output_ids: Sequence[int]


@dataclass(slots=True)
class _PenaltyRow:
    slot: int
    counted: int = 0  # generated tokens already in the slot's counts
    has_prompt: bool = False  # the slot's prompt-presence row is built


class PenaltyCounts:
    """Generated-token counts per request, and prompt presence for repetition penalties, kept on the device between
    steps in one slot per request and updated with the tokens generated since the last step (one scatter for the
    whole batch). Rebuilding them from the whole histories every step costs host work in the prompt and output
    lengths of every penalised row: on the CPU, 64 rows of 4,000-token prompts and 501 outputs at a vocabulary of
    32,000 took 39.9 ms a step to rebuild against 6.0 ms here (the penalty arithmetic after it is the same).
    ``release`` frees a request's slot (finish, abort)."""

    def __init__(self) -> None:
        self._rows: dict[str, _PenaltyRow] = {}
        self._free: list[int] = []
        self._counts: torch.Tensor | None = None  # [capacity, vocab] fp32
        self._prompt: torch.Tensor | None = None  # [capacity, vocab] bool, built on first need

    @property
    def capacity(self) -> int:
        """Slots allocated so far (grown by doubling from 8; a slot is a row of vocab counts)."""
        return 0 if self._counts is None else self._counts.shape[0]

    def release(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row.slot)

    def gather(self, histories: Sequence[PenaltyHistory], with_prompt: bool, vocab: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[R, vocab] generated counts and (``with_prompt``) [R, vocab] prompt presence, one row per history."""
        rows = [self._row(h.request_id, vocab, device) for h in histories]
        slots, ids = [], []
        for row, h in zip(rows, histories):
            slots += [row.slot] * (len(h.output_ids) - row.counted)
            ids += h.output_ids[row.counted :]
            row.counted = len(h.output_ids)
        if ids:
            flat = torch.tensor(slots, dtype=torch.int64) * vocab + torch.tensor(ids, dtype=torch.int64)
            flat = flat.to(device)
            self._counts.view(-1).index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=device))
        index = torch.tensor([row.slot for row in rows], dtype=torch.int64, device=device)
        if not with_prompt:
            return self._counts[index], None
        if self._prompt is None:
            self._prompt = torch.zeros(self._counts.shape, dtype=torch.bool, device=device)
        for row, h in zip(rows, histories):
            if not row.has_prompt:
                self._prompt[row.slot] = False
                self._prompt[row.slot, torch.tensor(list(h.token_ids[: h.num_prompt]), device=device)] = True
                row.has_prompt = True
        return self._counts[index], self._prompt[index]

    def _row(self, request_id: str, vocab: int, device: torch.device) -> _PenaltyRow:
        row = self._rows.get(request_id)
        if row is None:
            if not self._free:
                self._grow(vocab, device)
            row = self._rows[request_id] = _PenaltyRow(self._free.pop())
            self._counts[row.slot].zero_()
        return row

    def _grow(self, vocab: int, device: torch.device) -> None:
        old = self.capacity
        capacity = max(8, 2 * old)
        counts = torch.zeros(capacity, vocab, dtype=torch.float32, device=device)
        if self._counts is not None:
            counts[:old] = self._counts
        self._counts = counts
        if self._prompt is not None:
            prompt = torch.zeros(capacity, vocab, dtype=torch.bool, device=device)
            prompt[:old] = self._prompt
            self._prompt = prompt
        self._free.extend(range(capacity - 1, old - 1, -1))


class Sampler:
    def __init__(self) -> None:
        self.penalty_counts = PenaltyCounts()

    def release(self, request_id: str) -> None:
        self.penalty_counts.release(request_id)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence,
        generators: Mapping[int, torch.Generator] | Sequence[torch.Generator | None] | None = None,
        histories: Sequence[PenaltyHistory | None] | None = None,
        bans: Sequence[Sequence[int]] | None = None,
        allowed: Sequence[bytes | bytearray | None] | None = None,
    ) -> torch.Tensor:
        """logits[B, V] fp32, one SamplingParams-like object per row (temperature, top_k, top_p, and the penalties
        when ``histories`` is given).

        ``generators``: row index -> torch.Generator on logits' device for seeded rows (a list with None for unseeded
        rows also works). ``histories``: per row, a ``PenaltyHistory`` for the rows to penalise, None for the
        others (their counts persist in ``penalty_counts`` until ``release``). ``bans``: per row, token ids it may
        not pick (a request below its ``min_tokens``: EOS and its stop tokens). ``allowed``: per row, None or a
        mask of V bytes (1: the token may be picked), a guided request's. Returns token ids [B] int64 on logits'
        device.
        """
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} sampling params")
        logits = logits.float()
        rows = [i for i, h in enumerate(histories or ()) if h is not None]
        if rows:
            with_prompt = any(params[i].repetition_penalty != 1.0 for i in rows)
            generated, in_prompt = self.penalty_counts.gather([histories[i] for i in rows], with_prompt,
                                                              logits.shape[-1], logits.device)
            logits = penalize(logits, params, rows, generated, in_prompt)
        biases = [getattr(p, "logit_bias", ()) for p in params]
        if bans is not None and any(bans):
            biases = [(*bias, *((t, float("-inf")) for t in banned)) for bias, banned in zip(biases, bans)]
        if any(biases):
            logits = apply_logit_bias(logits, biases)
        if allowed is not None and any(a is not None for a in allowed):
            logits = apply_allowed(logits, allowed)
        greedy_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_EPS]
        if not random_rows:
            return greedy_ids
        rows = torch.tensor(random_rows, device=logits.device)
        probs = sampling_probs(
            logits[rows],
            temperatures=[params[i].temperature for i in random_rows],
            top_ks=[params[i].top_k for i in random_rows],
            top_ps=[params[i].top_p for i in random_rows],
            min_ps=[getattr(params[i], "min_p", 0.0) for i in random_rows],
        )
        noise = _exponential_noise(probs, [_generator_for(generators, i) for i in random_rows])
        greedy_ids[rows] = (probs / noise).argmax(dim=-1)
        return greedy_ids


def apply_penalties(
    logits: torch.Tensor, params: Sequence, histories: Sequence[tuple[Sequence[int], Sequence[int]] | None]
) -> torch.Tensor:
    """The pure reference: a copy of ``logits`` with each penalised row's repetition, frequency and presence
    penalties applied, from (prompt ids, generated ids) per row (None: not penalised)."""
    rows = [i for i, h in enumerate(histories) if h is not None]
    device, vocab = logits.device, logits.shape[-1]
    generated = _token_counts([histories[i][1] for i in rows], vocab, device)
    in_prompt = _token_counts([histories[i][0] for i in rows], vocab, device) > 0
    return penalize(logits, params, rows, generated, in_prompt)


def penalize(logits: torch.Tensor, params: Sequence, rows: list[int], generated: torch.Tensor,
             in_prompt: torch.Tensor | None) -> torch.Tensor:
    """A copy of ``logits`` with the penalties of ``rows`` applied from their [R, V] generated counts and prompt
    presence (needed only when some row has a repetition penalty)."""
    device = logits.device
    out = logits.clone()
    sub = out[rows]
    seen = generated > 0
    if any(params[i].repetition_penalty != 1.0 for i in rows):  # on the host: no device sync
        r = torch.tensor([params[i].repetition_penalty for i in rows], dtype=torch.float32, device=device)
        r = r.unsqueeze(1)
        sub = torch.where(in_prompt | seen, torch.where(sub > 0, sub / r, sub * r), sub)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], dtype=torch.float32, device=device)
    presence = torch.tensor([params[i].presence_penalty for i in rows], dtype=torch.float32, device=device)
    sub = sub - frequency.unsqueeze(1) * generated - presence.unsqueeze(1) * seen
    out[rows] = sub
    return out


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] fp32 counts, from one padded tensor and one scatter_add."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)  # column vocab: padding
    if width:
        ids = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
        for row, tokens in enumerate(token_lists):
            ids[row, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.int64)
        ids = ids.to(device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Sequence[tuple[int, float]]]) -> torch.Tensor:
    """A copy of ``logits`` with each row's (token id, bias) pairs added (one scatter for the batch)."""
    rows = [row for row, bias in enumerate(biases) for _ in bias]
    ids = [token for bias in biases for token, _ in bias]
    values = [value for bias in biases for _, value in bias]
    out = logits.clone()
    index = (torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device))
    out.index_put_(index, torch.tensor(values, dtype=out.dtype, device=logits.device), accumulate=True)
    return out


def apply_allowed(logits: torch.Tensor, allowed: Sequence[bytes | bytearray | None]) -> torch.Tensor:
    """A copy of ``logits`` with each masked row's disallowed tokens at -inf (rows with None untouched). The masks
    cross to the device as one [R, V] bool tensor built from the host bytes without a Python loop over tokens."""
    rows = [i for i, mask in enumerate(allowed) if mask is not None]
    vocab = logits.shape[-1]
    if any(len(allowed[i]) != vocab for i in rows):
        raise ValueError(f"an allowed-token mask does not cover the vocabulary of {vocab}")
    # frombuffer shares the host bytes (a bytearray: torch warns about read-only buffers, so bytes are copied)
    host = [allowed[i] if isinstance(allowed[i], bytearray) else bytearray(allowed[i]) for i in rows]
    masks = torch.stack([torch.frombuffer(mask, dtype=torch.bool) for mask in host]).to(logits.device)
    out = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    out[index] = out[index].masked_fill(~masks, float("-inf"))
    return out


def sampling_probs(
    logits: torch.Tensor, temperatures: Sequence[float], top_ks: Sequence[int], top_ps: Sequence[float],
    min_ps: Sequence[float] | None = None,
) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / T) restricted by min-p, top-k, then top-p,
    renormalised."""
    device = logits.device
    scaled = logits / torch.tensor(temperatures, dtype=torch.float32, device=device).unsqueeze(1)
    if min_ps is not None and any(p > 0.0 for p in min_ps):
        scaled = apply_min_p(scaled, torch.tensor(min_ps, dtype=torch.float32, device=device))
    # Each mask sorts the whole vocabulary; skip it when no row asks for it (the common decode case).
    if any(0 < k < logits.shape[-1] for k in top_ks):
        scaled = apply_top_k(scaled, torch.tensor(top_ks, device=device))
    if any(p < 1.0 for p in top_ps):
        scaled = apply_top_p(scaled, torch.tensor(top_ps, dtype=torch.float32, device=device))
    return torch.softmax(scaled, dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop each row's tokens whose probability is below min_p x its most likely token's (min_p 0: keep all). In
    logits: p_i / p_max = exp(l_i - l_max), so no softmax is needed."""
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_p).unsqueeze(1)  # log 0 = -inf keeps all
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (k <= 0 or k >= V: keep all); ties with the k-th value are kept."""
    vocab = logits.shape[-1]
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth_value = sorted_logits.gather(-1, (k - 1).unsqueeze(1).long())
    return logits.masked_fill(logits < kth_value, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (always at least the top one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with p >= 1 keep everything; the guard stops fp32 cumsum rounding from dropping the least likely token.
    drop_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _generator_for(generators, row: int) -> torch.Generator | None:
    if generators is None:
        return None
    if isinstance(generators, Mapping):
        return generators.get(row)
    return generators[row]


def _exponential_noise(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty_like(probs[unseeded]).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    # exponential_ may return exactly 0 on some back-ends; p / 0 would be inf (or nan for p = 0).
    return noise.clamp_(min=torch.finfo(torch.float32).tiny)
