"""``LLMEngine``: one step = schedule -> control decision -> apply -> run -> postprocess.

Control runs in two phases per step (``elastiserve.control.arbiter``): under pressure before scheduling (demote,
evict residuals, preempt) with the dry run's demand, and recovery after scheduling (promote, restore) with the free
capacity left. Mode switches happen between steps; a request that spans one is never recomputed.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from elastiserve.control.step_budget import StepBudget, StepBudgetConfig
from elastiserve.engine import step_probe
from elastiserve.engine.config import EngineConfig
from elastiserve.engine.errors import InvalidRequest
from elastiserve.engine.gc_watch import GcWatch, freeze_start_up
from elastiserve.engine.guided.masks import Guide, MaskCache, TokenTable
from elastiserve.engine.guided.vocab import vocabulary_bytes
from elastiserve.engine.kv_manager import KVManager
from elastiserve.engine.loader import resolve_device
from elastiserve.engine.observe import engine_stats, observe_step
from elastiserve.engine.outputs import CompletionResult, RequestOutput, TokenLogprob
from elastiserve.engine.prefix_cache import PrefixCache
from elastiserve.engine.runner import ModelRunner
from elastiserve.engine.sampling import SamplingParams
from elastiserve.engine.scheduler import Scheduler, StepDemand
from elastiserve.engine.sequence import Sequence, SequenceMetrics
from elastiserve.engine.stop_rules import StopRules, eos_ids_of
from elastiserve.engine.transitions import Transitions, make_policy
from elastiserve.engine.warmup import mode_sets
from elastiserve.platforms import ConfigError

__all__ = ["CompletionResult", "LLMEngine", "RequestOutput"]
log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        policy: Any = None,
        eos_token_ids: Seq[int] | None = None,
    ) -> None:
        """``model``/``tokenizer`` override the loader (tests); ``policy`` overrides the control preset
        (any object with ``decide_pressure(obs)`` and ``decide_recovery(obs)`` returning a ``Decision``, and with
        ``config.queue_fast_after_s`` or ``prefill_fast`` set, ``run_all_fast(now, oldest_queued_s, queued_prompts,
        carries_prefill)``)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.tp_group = None
        if config.tensor_parallel_size > 1:
            if model is not None:
                raise ConfigError("tensor parallelism loads the model in every rank from config.model: pass no model")
            from elastiserve.engine import tp

            self.tp_group = tp.start(config, self.device)  # spawns ranks 1..N-1, joins the group as rank 0
            self.device = self.tp_group.device
        try:
            self._build(model, tokenizer, policy, eos_token_ids)
        except BaseException:
            self.shutdown()  # the workers wait for plans that will never come
            raise

    def _build(self, model, tokenizer, policy, eos_token_ids) -> None:
        from elastiserve.control.events import EventLog

        config = self.config
        hf_config: dict = {}
        if model is None:
            from elastiserve.engine.loader import load_model

            model, hf_config, tokenizer = load_model(config)
        if self.tp_group is not None:
            from elastiserve.engine import tp

            tp.shard_model(model.to(self.device), self.tp_group)
        self.model = model.to(self.device)
        self.runner = ModelRunner(config, self.model, self.device)
        if self.tp_group is not None:
            self.runner = tp.TPRunner(self.runner, self.tp_group)
        self.kv = KVManager(
            self.runner.pool.block_pool,
            config.block_size,
            self.runner.host_backing.shape[0],
            sink_pairs=config.sink_pairs,
            recent_pairs=config.recent_pairs,
            prefix_cache=PrefixCache() if config.enable_prefix_caching else None,
        )
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   policy=config.scheduling_policy)
        self.step_budget = None if config.max_step_time_s is None else StepBudget(
            StepBudgetConfig(config.max_step_time_s, config.max_num_batched_tokens))
        self.policy = policy if policy is not None else make_policy(config)
        control = getattr(self.policy, "config", None)  # does demotion also make room for queued prompts?
        self._count_admissions = getattr(control, "demand_counts_admissions", True)
        self.scheduler.admission = self.kv.admission_bound(control, self.max_model_len)
        self.events = EventLog()
        eos = frozenset(eos_token_ids if eos_token_ids is not None else eos_ids_of(tokenizer, hf_config))
        self.stop_rules = StopRules(eos, tokenizer, self.max_model_len)  # holds the tokenizer and EOS ids (below)
        self.step_count = 0
        self.last_step: dict[str, Any] = {"step_tokens": 0, "step_seqs": 0, "step_s": 0.0, "gc_s": 0.0}
        self.gc_watch = GcWatch()  # the collector's seconds since the last step go into its record (gc_s)
        self._gc_mark = 0.0
        self._seq_ids = itertools.count()
        self._seq_index: dict[str, int] = {}
        precision = getattr(control, "precision", None)  # None: scripted test policies run the stale layers
        self.transitions = Transitions(config, self.kv, self.scheduler, self.runner, self.events, self.policy,
                                       precision, self._seq_index, self.model.config.num_hidden_layers)
        self._mask_cache = None  # guided.MaskCache over this model's vocabulary, built by the first guided request
        self._closed = False
        self.runner.warm_up()
        if self.step_budget is not None and self.device.type == "cuda":  # the CPU's steps are tests' (as warm-up)
            self.prime_step_budget()
        self._gc_frozen = self.runner.device.type == "cuda"
        if self._gc_frozen:
            freeze_start_up()
            if config.gc_in_step_shadow:
                self.gc_watch.take_over()
                self.runner.host_work_in_shadow = self.gc_watch.collect_due
        self.gc_watch.install()
        self._gc_mark = self.gc_watch.total_s

    def prime_step_budget(self) -> None:
        """Time probe steps in each whole-model mode and prime the budget with them (``step_probe``); on a GPU the
        engine does this once, after warm-up."""
        budget = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_layers = self.model.config.num_hidden_layers
        times = step_probe.probe_step_times(self.runner, mode_sets(self.config, num_layers),
                                            step_probe.probe_token_counts(budget), self.vocab_size)
        for mode, steps in times.items():
            self.step_budget.prime(mode, steps)
            log.info("step budget: %d fast layers primed with %s -> %d tokens", mode,
                     ", ".join(f"{t} tokens {s * 1e3:.1f} ms" for t, s in steps), self.step_budget.tokens(mode))

    @property
    def tokenizer(self) -> Any:
        return self.stop_rules.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self.stop_rules.tokenizer = tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.stop_rules.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.stop_rules.eos_token_ids = frozenset(ids)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + output one request may ask for: the context, or the whole KV pool if smaller."""
        return min(self.max_model_len, self.kv.pool.num_blocks * self.kv.block_size)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float | None = None,
        prefix_leader: str | None = None, priority: int = 0,
    ) -> None:
        """``prefix_leader``: a request already added with the same prompt (the first of ``n`` choices). With prefix
        caching this one is admitted once the leader's prefill is done, and its prompt's complete pairs come from
        the cache instead of being computed again; without prefix caching, when it scores its prompt (which
        computes every row), when no such request is queued or running, or when this one is served before it
        (a higher priority), it is ignored. ``priority``: lower is served first, under
        ``scheduling_policy="priority"`` only."""
        if request_id in self._seq_index:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if priority != 0 and not self.scheduler.by_priority:
            raise InvalidRequest(f"priority {priority} needs the priority scheduling policy (this engine is FCFS)")
        params.validate(self.vocab_size, self.max_model_len, len(prompt_token_ids))
        needed = self.kv.blocks_for(len(prompt_token_ids) + params.max_tokens)
        if needed > self.kv.pool.num_blocks:
            raise InvalidRequest(
                f"prompt + max_tokens need {needed} KV blocks but the whole pool has {self.kv.pool.num_blocks}"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids {bad[:4]} are outside the vocabulary")
        metrics = SequenceMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), params, metrics, priority=priority)
        if params.min_tokens:
            eos = () if params.ignore_eos else tuple(sorted(self.eos_token_ids))
            seq.banned_before_min = tuple(dict.fromkeys(params.stop_token_ids + eos))
        if params.guide is not None:
            seq.guide = Guide(params.guide, self._guide_masks())
        if params.prompt_logprobs is not None:  # nothing predicts the first token
            seq.prompt_logprobs = [TokenLogprob(seq.token_ids[0], None)]
        elif self.kv.prefix_cache is not None and prefix_leader is not None:
            leader = self.scheduler.find(prefix_leader)
            # Only a leader served no later than this request: one of a lower priority would be queued behind it,
            # and it (and the queue behind it) would wait for that leader forever (Scheduler.held_for_leader).
            if leader is not None and (not self.scheduler.by_priority or leader.priority_key <= seq.priority_key):
                seq.prefix_leader = prefix_leader
        self._seq_index[request_id] = next(self._seq_ids)
        self.scheduler.add(seq)

    def _guide_masks(self) -> MaskCache:
        if self._mask_cache is None:
            if self.tokenizer is None:
                raise InvalidRequest("guided decoding needs the model's tokenizer")
            table = TokenTable(vocabulary_bytes(self.tokenizer, self.vocab_size), self.eos_token_ids)
            self._mask_cache = MaskCache(table)
        return self._mask_cache

    def abort_request(self, request_id: str) -> bool:
        """Drop the request and free its blocks and host slots; False when it is unknown or already finished."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._forget(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_background_work(self) -> bool:
        """Restores or promotions that only progress while ``step()`` runs (an idle server keeps stepping)."""
        state = self.runner.pool.block_pool.state
        restorable = bool(state.fast_layers) and self.config.policy != "static-fp8"
        return restorable or bool(self.kv.promotions_in_flight())

    def _forget(self, seq: Sequence) -> None:
        self._seq_index.pop(seq.request_id, None)
        self.stop_rules.forget(seq.request_id)
        self.runner.release_request(seq.request_id)

    # ---- the step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.step_count += 1
        step, transitions = self.step_count, self.transitions
        transitions.publish_promotions(step)
        if self.step_budget is not None:  # before the probe, so that its dry run plans the same step
            # With prefill_fast every step that carries a chunk runs all layers fast: plan chunks at that budget.
            mode = transitions.num_layers if self.config.prefill_fast else len(self.runner.fast_layers)
            self.scheduler.step_tokens = self.step_budget.plan_tokens(mode, transitions.deferred_fast)
        transitions.apply(self.policy.decide_pressure(self._observe(self._probe())), step)
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self.events.add(time.monotonic(), step, "preempt", 1, f"no block for {seq.request_id}")
        transitions.apply(self.policy.decide_recovery(self._observe(None)), step)
        transitions.restore_between_steps(step)
        # A one-token chunk (the token a prefix-cache hit leaves to compute) reads as decode: it costs what one does.
        transitions.update_queue_fast(not batch.is_decode_only)
        transitions.sync_mode(step, self._budget_defers(batch))
        if batch.is_empty:
            self.gc_watch.collect_due()  # an idle engine has no device shadow: its passes run here
            return []
        start = time.perf_counter()
        out = self.runner.execute(batch, self.kv)  # ends on the sampled tokens' read-back: device work included
        seconds = time.perf_counter() - start
        gc_total = self.gc_watch.total_s
        self.last_step = {"step_tokens": batch.num_tokens, "step_seqs": len(batch.seqs), "step_s": seconds,
                          "gc_s": gc_total - self._gc_mark}  # since the previous step ended: between steps and in it
        self._gc_mark = gc_total
        if self.step_budget is not None and batch.num_tokens > len(batch.seqs):  # a step with a prefill chunk
            self.step_budget.record(len(self.runner.fast_layers), batch.num_tokens, seconds)
        for i, entries in (out.prompt_logprobs or {}).items():
            batch.seqs[i].prompt_logprobs += entries
        return self._postprocess(batch, out.token_ids, out.logprobs)

    def _budget_defers(self, batch):
        """``sync_mode``'s test of a switch to fewer fast layers against this step's tokens (None: nothing to test,
        no budget or a decode-only step)."""
        if self.step_budget is None or batch.num_tokens <= len(batch.seqs):
            return None
        current = len(self.runner.fast_layers)
        return lambda wanted: self.step_budget.defers(current, wanted, batch.num_tokens)

    def _probe(self) -> StepDemand | None:
        should = getattr(self.policy, "should_probe", None)
        if should is not None and not should(self.kv.num_free_blocks()):
            return None
        return self.scheduler.dry_run()

    def _postprocess(self, batch, tokens: list[int | None], logprobs: list | None = None) -> list[RequestOutput]:
        now = time.monotonic()
        fast = bool(self.runner.fast_layers)
        outputs = []
        for i, (seq, n, token) in enumerate(zip(batch.seqs, batch.num_new_tokens, tokens)):
            self.kv.record_exposure(seq, seq.num_computed_tokens + n)
            seq.num_computed_tokens += n
            self.kv.register_pairs(seq)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            if token is None:
                continue
            if seq.params.max_tokens == 0:  # the prompt is scored: nothing to generate
                self._finish(seq, "length", now)
                outputs.append(self._output(seq, [], prompt_logprobs=seq.prompt_logprobs))
                continue
            seq.token_ids.append(token)
            if seq.guide is not None and not seq.guide.advance(token):
                log.warning("request %s: token %d breaks its grammar (were all its tokens masked?)", seq.request_id,
                            token)
            seq.metrics.token_times.append(now)
            seq.metrics.fast_mode_tokens += fast
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            num_output = len(seq.token_ids) - seq.num_prompt_tokens
            reason = self.stop_rules.reason(seq, num_output)
            if reason is not None:
                self._finish(seq, reason, now)
            entry = logprobs[i] if logprobs is not None else None
            first = seq.prompt_logprobs if num_output == 1 else None
            outputs.append(self._output(seq, [token], [entry] if entry is not None else None, first))
        return outputs

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.finish_reason, seq.metrics.finished_time = reason, now
        self.scheduler.finish(seq)
        self._forget(seq)

    def _output(self, seq: Sequence, new_tokens: list[int], logprobs: list | None = None,
                prompt_logprobs: list | None = None) -> RequestOutput:
        finished = seq.is_finished
        text = None
        if finished and self.tokenizer is not None:
            text = seq.output_text or self.tokenizer.decode(seq.output_token_ids)
        return RequestOutput(
            seq.request_id, new_tokens, finished, seq.finish_reason, seq.num_prompt_tokens,
            seq.num_output_tokens, seq.metrics, text, logprobs, prompt_logprobs,
        )  # fmt: skip

    # ---- control ---------------------------------------------------------------------------------------------
    def _observe(self, demand: StepDemand | None):
        return observe_step(self.step_count, self.kv, self.scheduler, self.runner, demand, self._count_admissions)

    def demote(self, num_pairs: int, reason: str = "") -> int:
        """Demote up to ``num_pairs`` eligible pairs now (benchmarks of the host work; the control plane's own
        demotions go through ``step``)."""
        return self.transitions.demote(num_pairs, self.step_count, reason)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (a no-op on one device)."""
        if self.tp_group is not None:
            from elastiserve.engine import tp

            group, self.tp_group = self.tp_group, None
            # NCCL cannot destroy a communicator that live CUDA graphs captured collectives of: on two H200s every
            # rank hung in destroy_process_group until the graphs went first (on every rank: see tp.worker_main).
            runner = getattr(self, "runner", None)  # absent when startup failed before the runner existed
            if runner is not None:
                runner.graphs = None
            tp.stop(group)

    def close(self) -> None:
        """Give back the VMM ranges and units (garbage collection does not) so another engine can take the memory.
        A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.shutdown()
        self.gc_watch.remove()
        self.runner.graphs = None
        manager = self.runner.pool.manager
        if manager is not None:
            manager.close()
        if self._gc_frozen:  # the frozen objects may hold cycles through this engine: let them be collected
            gc.unfreeze()
            self._gc_frozen = False
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def force_fast_layers(self, layers: frozenset[int]) -> None:
        """Pin ``layers`` to fast mode (tests, demos); applies at the next step boundary."""
        self.runner.forced_fast_layers = frozenset(layers)

    # ---- conveniences ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams) -> list[CompletionResult]:
        ids = [f"gen-{self.step_count}-{i}" for i in range(len(prompts))]
        seqs = {}
        for request_id, prompt in zip(ids, prompts):
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.add_request(request_id, tokens, params)
            seqs[request_id] = self.scheduler.find(request_id)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
        results = []
        for request_id in ids:
            seq, out = seqs[request_id], finished[request_id]
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            results.append(
                CompletionResult(request_id, prompt, seq.output_token_ids, out.text, out.finish_reason, seq.metrics)
            )
        return results

    def stats(self) -> dict[str, Any]:
        """Counters, mode and KV state, the collector's passes (``gc_watch``), and the last executed step's tokens,
        sequences, seconds and collector seconds since the step before it (what a bench timeline needs to fit step
        times against tokens and to tell host pauses from steps)."""
        stats = engine_stats(self.step_count, self.kv, self.scheduler, self.runner, self.events)
        return stats | self.gc_watch.stats() | self.last_step

