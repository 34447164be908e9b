"""Steps timed before serving, to prime the step-time budget (``control.step_budget.StepBudget.prime``).

The budget learns each precision mode's seconds per token from served steps, and caps nothing in a mode until it
has ``min_samples`` of them. On the H200 (session 13, MoE headline, dps at 24 req/s, 3,072-token chunks) those
first full-mode steps took 136-154 ms, over the 123 ms TBT bound of every request running through them. Here the
engine times, right after warm-up, one prefill-only step per size at a quarter, a half, three quarters and all of
the chunk budget, twice each after one untimed run, in every whole-model mode the policy reaches.

The probe steps go through the runner's ordinary ``run`` (so through the mixed-step graphs where they are
captured, and to every tensor-parallel rank) with random token ids, so that a MoE router spreads them over the
experts as served tokens are (identical ids would route every token to the same eight). They write no KV (every
slot is -1) and read block 0 only. They carry no decode rows, so they miss the decodes' attention: served steps come
out above their line, and that excess becomes the fit's margin from the first served step on.
"""

from __future__ import annotations

import random
import time
from typing import Any

from elastiserve.control.step_budget import probe_token_counts
from elastiserve.engine.step_inputs import StepInputs

__all__ = ["probe_inputs", "probe_step_times", "probe_token_counts"]
PROBE_REPEATS = 2  # timed runs per size, after one untimed


def probe_inputs(num_tokens: int, vocab_size: int, seed: int = 0) -> StepInputs:
    """One sequence of ``num_tokens`` new tokens that writes nothing, reads block 0 and samples nothing."""
    rng = random.Random(seed)
    return StepInputs(
        tokens=[rng.randrange(vocab_size) for _ in range(num_tokens)],
        positions=list(range(num_tokens)),
        slots=[-1] * num_tokens,
        query_lens=[num_tokens],
        seq_lens=[num_tokens],
        block_tables=[[0]],
        base_bounds=[(0, 0)],
    )


def probe_step_times(runner: Any, mode_sets: list[frozenset[int]], token_counts: list[int], vocab_size: int,
                     repeats: int = PROBE_REPEATS) -> dict[int, list[tuple[int, float]]]:
    """(tokens, seconds) per mode (its number of fast layers), each timed from the inputs to the device being done,
    as the engine times a served step (which also waits for its sampled tokens)."""
    before = runner.fast_layers
    times: dict[int, list[tuple[int, float]]] = {}
    try:
        for fast_layers in mode_sets:
            runner.set_fast_layers(fast_layers)
            samples = times.setdefault(len(fast_layers), [])
            for num_tokens in token_counts:
                inputs = probe_inputs(num_tokens, vocab_size, seed=num_tokens)
                runner.run(inputs)
                for _ in range(repeats):
                    runner.synchronize()
                    start = time.perf_counter()
                    runner.run(inputs)
                    runner.synchronize()
                    samples.append((num_tokens, time.perf_counter() - start))
    finally:
        runner.set_fast_layers(before)
    return times
