"""Helpers of the engine decode scripts (``bench_decode.py``, ``profile_decode_kernels.py``, ``profile_mixed_step.py``,
``bench_prefix_cache.py``): a random-weight engine from a model spec, run metadata, graph-replay timing, and decode
batches started on an engine and turned into one step's inputs."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from elastiserve.engine.bench.results import git_commit
from elastiserve.engine.config import NESTED_POLICIES, SWITCHING_POLICIES, EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.runner import ModelRunner, StepInputs
from elastiserve.engine.sampling import SamplingParams

GIB = 1 << 30


# ---- setup -----------------------------------------------------------------------------------------------------
def resolve_model(spec: str, workdir: Path) -> str:
    """A config dict (JSON text) or a config.json file becomes a directory the loader understands."""
    text = None
    if spec.lstrip().startswith("{"):
        text = spec
    elif spec.endswith(".json") and Path(spec).is_file():
        text = Path(spec).read_text()
    if text is None:
        return spec
    model_dir = workdir / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(json.loads(text)))
    return str(model_dir)


def build_engine(args: argparse.Namespace, policy: str, *, max_num_seqs: int, kv_bytes: int | None,
                 queue_fast_after_s: float | None = None) -> LLMEngine:
    """``queue_fast_after_s`` applies to the policies that switch precision (dps, combined) and is dropped for the
    others; ``args.nest_lm_head`` and ``args.lm_head_exact_top`` (where the script has them) to the nested-weight
    policies."""
    queue_fast = queue_fast_after_s if policy in SWITCHING_POLICIES else None
    nest_lm_head = bool(getattr(args, "nest_lm_head", False)) and policy in NESTED_POLICIES
    config = EngineConfig(model=args.model_dir, policy=policy, device=args.device, load_format="dummy",
                          max_num_seqs=max_num_seqs, max_model_len=args.max_model_len, kv_cache_budget=kv_bytes,
                          cpu_kv_blocks=args.cpu_kv_blocks, seed=args.seed, queue_fast_after_s=queue_fast,
                          nest_lm_head=nest_lm_head,
                          lm_head_exact_top=int(getattr(args, "lm_head_exact_top", 0)) if nest_lm_head else 0)
    return LLMEngine(config, eos_token_ids=())


def free_device_memory() -> None:
    """After an engine is closed and its last name dropped (``del``): collect it and hand its cached blocks back
    (a name still bound to a closed engine keeps its weights alive while the next one loads)."""
    gc.collect()
    torch.cuda.empty_cache()


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    import triton

    commit = git_commit(Path(__file__).resolve().parent)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    from elastiserve.platforms import current_platform

    settings = {k: v for k, v in vars(args).items() if k not in ("out", "model_dir")}
    settings["programmatic_launch"] = current_platform().programmatic_launch  # ELASTISERVE_PDL
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__, "python":
            platform.python_version(), "commit": commit, "host": platform.node(), "settings": settings}


# ---- timing ----------------------------------------------------------------------------------------------------
def time_calls(fn, device: torch.device, iters: int, trials: int) -> dict[str, float]:
    """Seconds per call: CUDA events around ``iters`` back-to-back calls on a GPU (wall clock on the CPU)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(trials):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) / iters)
    samples.sort()
    return {"median_s": statistics.median(samples), "min_s": samples[0], "max_s": samples[-1]}


def copy_bandwidth(device: torch.device, nbytes: int, iters: int, trials: int) -> dict[str, float]:
    """Device-to-device copy of ``nbytes``: bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
    dst = torch.empty_like(src)
    t = time_calls(lambda: dst.copy_(src), device, iters, trials)
    return {"bytes": nbytes, "seconds": t["median_s"], "bytes_per_s": 2 * nbytes / t["median_s"]}


# ---- decode batches --------------------------------------------------------------------------------------------
def prompt_ids(vocab: int, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def start_decoding(engine: LLMEngine, batch: int, context: int, max_tokens: int, tag: str) -> list[str]:
    """Add ``batch`` requests of ``context`` prompt tokens and step until every one of them is decoding."""
    if context + max_tokens > engine.max_model_len:
        raise ValueError(f"--context {context} + {max_tokens} decode steps exceed max_model_len {engine.max_model_len}")
    rng = random.Random(batch * 7919 + context)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, prompt_ids(engine.vocab_size, context, rng), params)
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    if missing := [rid for rid in ids if rid not in running]:
        # The first requests decode while later ones prefill: at batch 128 x 512 tokens, 31 of them had spent
        # max_tokens 8 before the last prefill chunk ran (session 30).
        raise RuntimeError(f"{len(missing)} of {batch} requests finished before the others' prefill did: "
                           f"raise max_tokens ({max_tokens})")
    return ids


def decode_inputs(engine: LLMEngine, batch: int, context: int) -> StepInputs:
    """The inputs of one real decode step of ``batch`` sequences (scheduled once, never executed by the engine)."""
    # As many tokens as the model length allows: the step is scheduled once and never run, and every request
    # must still be decoding when the last one's prefill ends.
    start_decoding(engine, batch, context, max_tokens=engine.max_model_len - context, tag="dec")
    scheduled = engine.scheduler.schedule()
    if not scheduled.is_decode_only or len(scheduled.seqs) != batch:
        raise RuntimeError(f"expected a decode batch of {batch}, got {scheduled.num_new_tokens}")
    return ModelRunner.step_inputs(scheduled, engine.kv)


def first_rows(inputs: StepInputs, n: int) -> StepInputs:
    return StepInputs(inputs.tokens[:n], inputs.positions[:n], inputs.slots[:n], inputs.query_lens[:n],
                      inputs.seq_lens[:n], inputs.block_tables[:n], inputs.base_bounds[:n],
                      {i: modes for i, modes in inputs.pair_modes.items() if i < n})


def decode_step_fn(runner: ModelRunner, inputs: StepInputs, with_logits: bool = True):
    """One decode step (graph replay on a GPU, eager forward elsewhere) in the runner's current mode."""
    n = len(inputs.seq_lens)
    shape = runner.graphs.step_shape(n, n, is_decode=True) if runner.graphs is not None else None
    with torch.inference_mode():
        metadata = runner.load_inputs(inputs, shape)
        captured = runner.graphs.get(shape, metadata.path) if shape is not None else None

    @torch.inference_mode()
    def step():
        hidden = captured.replay()[:n] if captured is not None else runner.forward(n, metadata)
        return runner.model.compute_logits(hidden) if with_logits else hidden

    return step, shape.batch if shape is not None else n


def time_modes(engine: LLMEngine, inputs: StepInputs, batches: list[int], modes: dict[str, frozenset[int]],
               args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        for name, layers in modes.items():
            engine.runner.set_fast_layers(layers)
            fn, padded = decode_step_fn(engine.runner, first_rows(inputs, b))
            row[f"{name}_s"] = time_calls(fn, engine.device, args.iters, args.trials)["median_s"]
            row["padded_batch"] = padded
        rows.append(row)
    engine.runner.set_fast_layers(frozenset())
    return rows


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """fp16 bytes a decode step reads: every decoder layer, the final norm and lm_head (embedding: one row each)."""
    params = list(model.decoder_layers.parameters()) + list(model.norm.parameters()) + [model.lm_head.weight]
    return sum(p.numel() * p.element_size() for p in params)


def kv_bytes_read(model_config: Any, tokens: int) -> int:
    mc = model_config
    return tokens * mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 2


# ---- what a timed loop did besides its steps -------------------------------------------------------------------
_COMPILES: list[tuple[str, str]] = []  # (kernel, Triton's repr of the variant) of every compile in this process


def log_compiles() -> None:
    """Record every Triton compile of this process from now on (``_COMPILES``), keeping any hook already set, so
    that ``LoopWatch`` can name what a variant compiled inside a timed loop differs in from those compiled before."""
    import triton

    knobs = triton.knobs.runtime
    previous = knobs.jit_post_compile_hook
    if getattr(previous, "_logs_compiles", False):
        return

    def hook(*, fn, repr, **rest: Any) -> Any:
        _COMPILES.append((fn.name, repr + constexpr_suffix(fn, rest.get("compile") or {})))
        return previous(fn=fn, repr=repr, **rest) if previous is not None else None

    hook._logs_compiles = True
    knobs.jit_post_compile_hook = hook


def constexpr_suffix(fn: Any, compile_info: dict) -> str:
    """`` constexprs(NAME=value, ...)``: the constexpr values of a compiled variant, which Triton's repr leaves out
    (it prints their type only); the hook's ``compile["constants"]`` keys them by argument path."""
    names = getattr(getattr(fn, "jit_function", None), "arg_names", [])
    parts = []
    for path, value in (compile_info.get("constants") or {}).items():
        index = path[0] if isinstance(path, tuple) and len(path) == 1 else path
        parts.append(f"{names[index] if isinstance(index, int) and index < len(names) else path}={value}")
    return f" constexprs({', '.join(sorted(parts))})" if parts else ""


def variant_args(variant: str) -> dict[str, str]:
    """``name[options](arg: type, ...) constexprs(NAME=value, ...)`` (Triton's repr of a compiled variant, and
    ``constexpr_suffix``) as {arg: type or =value, "options": ...}; the type carries the specialization
    (``constexpr`` for an integer 1, a trailing ``D`` for 16-divisible)."""
    variant, _, constants = variant.partition(" constexprs(")
    head, _, args = variant.partition("](")
    out = {"options": head.partition("[")[2]}
    for part in args.rstrip(")").split(", "):
        name, sep, ty = part.partition(": ")
        if sep:
            out[name] = ty
    for part in constants.rstrip(")").split(", "):
        name, sep, value = part.partition("=")
        if sep:
            out[name] = f"={value}"
    return out


def variant_difference(variant: str, earlier: list[str]) -> str:
    """The arguments in which ``variant`` differs from the nearest of ``earlier`` (same kernel), as
    ``arg: before -> now``; every argument when there is no earlier variant."""
    now = variant_args(variant)
    best: dict[str, tuple[str | None, str]] | None = None
    for other in earlier:
        before = variant_args(other)
        diff = {k: (before.get(k), v) for k, v in now.items() if before.get(k) != v}
        if best is None or len(diff) < len(best):
            best = diff
    if best is None:
        return "first variant of this kernel"
    return "; ".join(f"{k}: {b} -> {v}" for k, (b, v) in best.items())


class LoopWatch:
    """Around a timed engine loop: the Triton kernels compiled inside it (a variant the engine's warm-up missed
    compiles, or loads from the disk cache, inside somebody's step), with the arguments each differs in from the
    nearest variant compiled before the loop (``log_compiles`` must be on from before the engine was built), the
    CUDA graphs captured inside it, and each step's seconds (``LLMEngine.stats()["step_s"]``, read by
    ``step_done``), split by whether the step ran any layer in FP8. Written to tell a slow policy's steps from its
    one-off costs: session 24's dps was 7.8 ms a step slower than static-fp8; session 25 found the first nested
    engine of a process compiling 17 variants in its loop (20 s in 30 steps), whichever policy it was."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.step_s: list[float] = []
        self.fast_step_s: list[float] = []  # steps with at least one layer in FP8
        self._graphs = self._num_graphs()
        self._last = engine.last_step
        self._first = self._end = 0

    def _num_graphs(self) -> int:
        graphs = getattr(self.engine.runner, "graphs", None)
        return 0 if graphs is None else len(graphs.graphs)

    def __enter__(self) -> LoopWatch:
        log_compiles()
        self._first = self._end = len(_COMPILES)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._end = len(_COMPILES)

    @property
    def compiled(self) -> list[tuple[str, str]]:
        return _COMPILES[self._first:self._end]

    def step_done(self) -> None:
        last = self.engine.last_step  # a new dict for every step that ran a batch; an empty step keeps the old one
        if last is not self._last and "step_s" in last:
            self.step_s.append(last["step_s"])
            if self.engine.runner.fast_layers:  # what that step ran (the next switch happens inside the next step)
                self.fast_step_s.append(last["step_s"])
        self._last = last

    def summary(self) -> dict[str, Any]:
        steps = sorted(self.step_s)
        median = statistics.median(steps) if steps else 0.0
        slow = [s for s in steps if s > 10 * median]
        before = _COMPILES[:self._first]
        variants = [{"kernel": name, "differs_in": variant_difference(v, [r for n, r in before if n == name])}
                    for name, v in self.compiled]
        return {"compiles_in_loop": len(self.compiled), "compiled_kernels": sorted({n for n, _ in self.compiled}),
                "compiled_variants": variants,
                "graphs_captured_in_loop": self._num_graphs() - self._graphs,
                "step_s": {"median": median, "p90": steps[int(0.9 * len(steps))] if steps else 0.0,
                           "max": steps[-1] if steps else 0.0, "sum": sum(steps)},
                "steps_over_10x_median": len(slow), "seconds_in_those": sum(slow),
                "fast_steps": len(self.fast_step_s), "fast_step_s_sum": sum(self.fast_step_s),
                "full_steps": len(steps) - len(self.fast_step_s),
                "full_step_s_sum": sum(steps) - sum(self.fast_step_s)}
