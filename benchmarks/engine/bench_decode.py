"""Engine decode benchmarks with random weights (``load_format="dummy"``), one JSON per run.

(a) roofline: batch-1 decode step in static-fp16 (CUDA-graph replay + logits, CUDA events around many steps, median)
    against the HBM roofline = bytes read per step (fp16 weights of the decoder, final norm and lm_head, plus the KV of
    the context) / step time / device-to-device copy bandwidth measured in the same run (bytes read + written).
    Target >= 75 %.
(b) fast vs full: the same replay at each batch size on a DPS engine, the runner switched between all-full and
    all-fast layers (``ModelRunner.set_fast_layers``) between measurements; static-fp16 at the same batch sizes as
    the reference. Target fast >= 1.6x faster than full.
(c) switch: a steady decode batch on a DPS engine; ``LLMEngine.force_fast_layers`` full -> fast (the first time,
    the fast graph is captured lazily: "cold"), back to full, and full -> fast again ("warm"). Every step's wall time
    is recorded; the report checks the switch applies at the next step, no request is recomputed (its token count
    grows by one each step, no preemption) and the longest step around each switch against the steady median.
(d) throughput: offline, ShareGPT lengths (``elastiserve.control.workloads``, capped to ``--max-model-len``), all
    requests added at once, per policy: output tokens/s and total time.

    python benchmarks/engine/bench_decode.py --model llama-3.1-8b --out decode.json
    python benchmarks/engine/bench_decode.py --device cpu --model '{"architectures": [...], ...}' --requests 8 ...

``--nest-lm-head`` gives the nested policies' engines a nested lm_head (``EngineConfig.nest_lm_head``): in (b) fast
mode then reads its upper plane too; ``--lm-head-exact-top N`` keeps its N largest logits a row exact there.

``--model`` is a built-in name (llama-3.1-8b, qwen3-8b, ...), a directory with config.json, a config.json file, or
a config dict as JSON text (written to a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from decode_setup import (
    GIB,
    LoopWatch,
    build_engine,
    copy_bandwidth,
    decode_inputs,
    decode_step_fn,
    first_rows,
    free_device_memory,
    kv_bytes_read,
    log_compiles,
    metadata,
    prompt_ids,
    resolve_model,
    start_decoding,
    time_calls,
    time_modes,
    weight_bytes_per_step,
)

from elastiserve.engine.config import POLICIES
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams

PARTS = ("roofline", "fast_full", "switch", "throughput")


# ---- (a) + static-fp16 reference, (b), (c), (d) ----------------------------------------------------------------
def run_fp16(args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    batches = sorted(set(batches) | {1})  # batch 1 is the roofline's step
    engine = build_engine(args, "static-fp16", max_num_seqs=max(batches), kv_bytes=args.kv_bytes)
    inputs = decode_inputs(engine, max(batches), args.context)
    steps = time_modes(engine, inputs, batches, {"fp16": frozenset()}, args)
    one = first_rows(inputs, 1)
    fn, _ = decode_step_fn(engine.runner, one, with_logits=False)
    forward_only = time_calls(fn, engine.device, args.iters, args.trials)["median_s"]
    weights = weight_bytes_per_step(engine.model)
    kv = kv_bytes_read(engine.model.config, one.seq_lens[0])
    engine.close()
    del engine
    free_device_memory()
    copy = copy_bandwidth(torch.device(args.device), args.copy_bytes, args.iters, args.trials)
    step = next(r["fp16_s"] for r in steps if r["batch"] == 1)
    roofline = {"step_s": step, "forward_only_s": forward_only, "weight_bytes": weights, "kv_bytes": kv,
                "context": args.context, "copy": copy, "target": 0.75,
                "fraction": (weights + kv) / step / copy["bytes_per_s"]}
    roofline["met"] = bool(roofline["fraction"] >= 0.75)
    return {"roofline": roofline, "fp16_steps": steps}


def run_switch(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    """full -> fast (cold) -> full -> fast (warm), ``args.switch_steps`` steps in each mode."""
    n_layers = engine.model.config.num_hidden_layers
    plan = [frozenset(), frozenset(range(n_layers)), frozenset(), frozenset(range(n_layers))]
    per_mode = args.switch_steps
    ids = start_decoding(engine, args.switch_batch, args.context, len(plan) * per_mode + 8, tag="sw")
    seqs = [engine.scheduler.find(rid) for rid in ids]
    preempt0 = engine.scheduler.num_preemptions
    graphs = engine.runner.graphs
    shape = graphs.step_shape(len(ids), len(ids), is_decode=True) if graphs is not None else None
    fast_graph_ready = graphs is not None and any(k[0] == shape and k[1] == plan[1] for k in graphs.graphs)
    records, problems, late = [], [], []
    for phase, layers in enumerate(plan):
        engine.force_fast_layers(layers)
        for k in range(per_mode):
            before = [(s.num_output_tokens, s.num_computed_tokens) for s in seqs]
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            after = [(s.num_output_tokens, s.num_computed_tokens) for s in seqs]
            fast = len(engine.runner.fast_layers)
            records.append({"phase": phase, "k": k, "wall_s": wall, "fast_layers": fast})
            if any(a[0] != b[0] + 1 or a[1] != b[1] + 1 for a, b in zip(after, before)):
                problems.append(f"phase {phase} step {k}: a request did not advance by exactly one token")
            if k == 0 and fast != len(layers):
                late.append(f"phase {phase}: mode not applied at the first step after the switch")
    if engine.scheduler.num_preemptions != preempt0:
        problems.append("preemptions during the switch run")
    switches = []
    if graphs is None:
        first = "full->fast (eager, no CUDA graphs)"
    else:
        first = f"full->fast (fast graph {'already captured' if fast_graph_ready else 'captured at this switch'})"
    for phase, name in ((1, first), (2, "fast->full"), (3, "full->fast (again)")):
        prev = [r["wall_s"] for r in records if r["phase"] == phase - 1][2:]
        new = [r["wall_s"] for r in records if r["phase"] == phase]
        window = new[:3]
        median_prev = statistics.median(prev)
        switches.append({"switch": name, "median_before_s": median_prev, "median_after_s": statistics.median(new[3:]),
                         "max_first3_after_s": max(window), "max_over_median_before": max(window) / median_prev})
    for abort_id in ids:
        engine.abort_request(abort_id)
    engine.force_fast_layers(frozenset())
    return {"batch": args.switch_batch, "context": args.context, "steps": records, "switches": switches,
            "applies_next_step": not late, "no_recompute": not problems, "problems": problems + late,
            "fast_graph_captured_before": fast_graph_ready}


def run_dps(args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    engine = build_engine(args, "dps", max_num_seqs=max([*batches, args.switch_batch]), kv_bytes=args.kv_bytes)
    out: dict[str, Any] = {}
    if "fast_full" in args.parts:
        inputs = decode_inputs(engine, max(batches), args.context)
        all_layers = frozenset(range(engine.model.config.num_hidden_layers))
        rows = time_modes(engine, inputs, batches, {"full": frozenset(), "fast": all_layers}, args)
        for row in rows:
            row["fast_speedup"] = row["full_s"] / row["fast_s"]
        out["fast_full"] = rows
        out["fast_full_target"] = {"speedup": 1.6, "met": all(r["fast_speedup"] >= 1.6 for r in rows)}
        for seq in list(engine.scheduler.running):
            engine.abort_request(seq.request_id)
    if "switch" in args.parts:
        out["switch"] = run_switch(engine, args)
    engine.close()
    del engine
    free_device_memory()
    return out


def sharegpt_requests(args: argparse.Namespace) -> tuple[list[tuple[int, int]], str]:
    from elastiserve.control import workloads

    trace_dir = Path(args.trace_dir) if args.trace_dir else None
    for name in (args.trace, "sharegpt-v3", "sharegpt"):
        try:
            reqs = workloads.load_trace(name, 0, args.requests, rate=1.0, trace_dir=trace_dir)
            break
        except workloads.TraceNotFound:
            print(f"trace {name!r} not found; trying the next ShareGPT table", file=sys.stderr)
    else:
        print("WARNING: no ShareGPT table found: using the bundled Azure conversation window", file=sys.stderr)
        name, reqs = "azure-window", workloads.load_trace("azure-window", 0, args.requests)
    cap = args.max_model_len
    lengths = []
    for r in reqs:
        prompt = min(r.prompt_tokens, cap - 1)
        lengths.append((prompt, max(1, min(r.output_tokens, cap - prompt))))
    return lengths, name


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    lengths, trace = sharegpt_requests(args)
    log_compiles()  # before any engine: LoopWatch compares the loop's compiles with every one before it
    rows = []
    for policy in args.policies:
        engine = build_engine(args, policy, max_num_seqs=args.max_num_seqs, kv_bytes=args.throughput_kv_bytes,
                              queue_fast_after_s=args.queue_fast_after)
        rng = random.Random(args.seed)
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        warm_lens = [min(16 + 8 * i, args.max_model_len - 4) for i in range(4)]
        engine.generate([prompt_ids(engine.vocab_size, n, rng) for n in warm_lens], warm)  # compiles the kernels
        before = engine.stats()
        for i, (p, o) in enumerate(lengths):
            params = SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
            engine.add_request(f"tp-{i}", prompt_ids(engine.vocab_size, p, rng), params)
        produced = 0
        with LoopWatch(engine) as watch:
            t0 = time.perf_counter()
            while engine.has_unfinished():
                produced += sum(len(out.new_token_ids) for out in engine.step())
                watch.step_done()
            total = time.perf_counter() - t0
        stats = engine.stats()
        rows.append({"policy": policy, "requests": len(lengths), "output_tokens": produced, "total_s": total,
                     "output_tokens_per_s": produced / total, "preemptions": stats["preemptions"] -
                     before["preemptions"], "steps": stats["steps"] - before["steps"],
                     "transitions": stats["transitions"], "kv_blocks": stats["total_blocks"], **watch.summary()})
        print(f"throughput {json.dumps(rows[-1])}", flush=True)  # kept in the log if a time limit cuts the run
        for variant in rows[-1]["compiled_variants"]:
            print(f"    compiled in the loop: {variant['kernel']}: {variant['differs_in']}", flush=True)
        engine.close()
        del engine
        free_device_memory()
    return {"trace": trace, "prompt_tokens": sum(p for p, _ in lengths), "max_model_len": args.max_model_len,
            "policies": rows}


# ---- report ----------------------------------------------------------------------------------------------------
def format_report(result: dict[str, Any]) -> str:
    lines = []
    if "roofline" in result:
        r = result["roofline"]
        lines.append(f"(a) batch-1 static-fp16 decode step {r['step_s'] * 1e3:.3f} ms (forward only "
                     f"{r['forward_only_s'] * 1e3:.3f} ms), {(r['weight_bytes'] + r['kv_bytes']) / 1e9:.2f} GB read, "
                     f"copy {r['copy']['bytes_per_s'] / 1e12:.2f} TB/s -> {100 * r['fraction']:.1f} % of roofline "
                     f"(target 75 %: {'met' if r['met'] else 'MISSED'})")
    if "fast_full" in result:
        fp16 = {r["batch"]: r["fp16_s"] for r in result.get("fp16_steps", [])}
        lines.append("(b) batch | fp16 ms | full ms | fast ms | fast/full speedup (target 1.6x) | fast vs fp16")
        for r in result["fast_full"]:
            ref = fp16.get(r["batch"], math.nan)
            lines.append(f"    {r['batch']:5d} | {ref * 1e3:7.3f} | {r['full_s'] * 1e3:7.3f} | {r['fast_s'] * 1e3:7.3f}"
                         f" | {r['fast_speedup']:5.2f}x | {ref / r['fast_s']:5.2f}x")
    if "switch" in result:
        s = result["switch"]
        lines.append(f"(c) switch, batch {s['batch']}: applies at the next step "
                     f"{'yes' if s['applies_next_step'] else 'NO'}, no recompute "
                     f"{'yes' if s['no_recompute'] else 'NO'} {'; '.join(s['problems'][:3])}")
        for sw in s["switches"]:
            lines.append(f"    {sw['switch']}: max step of the first 3 after {sw['max_first3_after_s'] * 1e3:.2f} ms"
                         f" = {sw['max_over_median_before']:.2f}x the median before "
                         f"({sw['median_before_s'] * 1e3:.2f} ms; after {sw['median_after_s'] * 1e3:.2f} ms)")
    if "throughput" in result:
        t = result["throughput"]
        lines.append(f"(d) offline throughput, {t['trace']}, max_model_len {t['max_model_len']}")
        for r in t["policies"]:
            lines.append(f"    {r['policy']:12s} {r['output_tokens']:8d} tokens {r['total_s']:8.1f} s "
                         f"{r['output_tokens_per_s']:9.1f} tok/s  preemptions {r['preemptions']}  steps: median "
                         f"{r['step_s']['median'] * 1e3:.2f} ms, {r['step_s']['sum']:.1f} s in all, "
                         f"{r['full_steps']} full ({r['full_step_s_sum']:.1f} s); "
                         f"{r['compiles_in_loop']} compiles, {r['graphs_captured_in_loop']} captures in the loop")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batch", dest="batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding sequence in (a)-(c)")
    p.add_argument("--kv-gib", type=float, default=4.0, help="KV pool of the (a)-(c) engines")
    p.add_argument("--iters", type=int, default=50, help="decode steps between two CUDA events")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--copy-gib", type=float, default=2.0)
    p.add_argument("--switch-batch", type=int, default=16)
    p.add_argument("--switch-steps", type=int, default=12, help="steps in each mode of the switch run")
    p.add_argument("--requests", type=int, default=1000, help="(d): ShareGPT requests")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--trace", default="sharegpt-v3")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256, help="(d)")
    p.add_argument("--throughput-kv-gib", type=float, default=24.0, help="(d): KV pool per policy")
    p.add_argument("--queue-fast-after", type=float, default=None,
                   help="(d): dps and combined run every layer in FP8 while a request has waited this long (s)")
    p.add_argument("--nest-lm-head", action="store_true",
                   help="nested policies nest lm_head too (EngineConfig.nest_lm_head): fast mode reads its upper plane")
    p.add_argument("--lm-head-exact-top", type=int, default=0,
                   help="with --nest-lm-head: fast mode's head keeps this many logits a row exact (0: off)")
    p.add_argument("--cpu-kv-blocks", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8-min-rows-quantized", type=int, default=None,
                   help="fast mode's fp8 threshold for rows quantized by a norm or SiLU-and-mul on this GPU "
                        "(nested_gemm.FP8_MIN_M_QUANTIZED_INPUT); default: the table's")
    p.add_argument("--fp8-min-rows-quantized-long", type=int, default=None,
                   help="the same for rows longer than QUANT_SHORT_K, down_proj's "
                        "(nested_gemm.FP8_MIN_M_QUANTIZED_LONG_INPUT); default: the table's")
    p.add_argument("--split-k-merge", type=int, choices=(0, 1), default=None,
                   help="1: split-K partials summed in the GEMM launch (nested_gemm.SPLIT_K_MERGE); "
                        "default: the table's")
    p.add_argument("--l2-prefetch", nargs="*", type=_mode_share, default=None, metavar="MODE=SHARE",
                   help="share of the L2 one decode GEMM launch in MODE (full, weight_only, fp8, plain) may prefetch "
                        "weights into before waiting on the kernel before it, replacing this GPU's row of "
                        "l2_prefetch.L2_PREFETCH_SHARE (no values: off); default: the table's")
    p.add_argument("--skinny-plain-max-rows", type=int, default=None,
                   help="most rows a plain fp16 linear (lm_head; every linear of static-fp16) sends to the skinny "
                        "kernel on this GPU (skinny_configs.SKINNY_MAX_M[arch]['plain']; 0: none); default: the "
                        "table's")
    p.add_argument("--fp8-min-rows", type=int, default=None,
                   help="fp8 threshold for fp16 rows (o_proj) (nested_gemm.FP8_MIN_M); default: the table's")
    p.add_argument("--split-quant-max-rows", type=int, default=None,
                   help="most rows the quantizing SiLU-and-mul splits over programs (silu_mul.SPLIT_QUANT_MAX_ROWS; "
                        "0: one program a row); default: the table's")
    p.add_argument("--quant-split-rows", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="rows (LOW-HIGH) at which the quantizer splits rows longer than 4,096 over programs "
                        "(fp8_activations.QUANT_SPLIT_ROWS; no arch as committed); default: the table's")
    p.add_argument("--attention-stages", type=int, default=None,
                   help="pipeline stages of every attention launch (attention.NUM_STAGES); default: the module's")
    args = p.parse_args(argv)
    args.batches = sorted(set(args.batches))
    if args.switch_steps < 4:
        p.error("--switch-steps must be >= 4 (the medians skip the steps next to a switch)")
    on_gpu = args.device == "cuda"
    args.kv_bytes = int(args.kv_gib * GIB) if on_gpu else None
    args.throughput_kv_bytes = int(args.throughput_kv_gib * GIB) if on_gpu else None
    args.copy_bytes = int(args.copy_gib * GIB) if on_gpu else 64 << 20
    return args


def _mode_share(text: str) -> tuple[str, float]:
    mode, _, share = text.partition("=")
    if mode not in ("full", "weight_only", "fp8", "plain") or not share:
        raise argparse.ArgumentTypeError(f"expected MODE=SHARE with MODE full, weight_only, fp8 or plain: {text!r}")
    value = float(share)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share of the L2 is in [0, 1], got {value}")
    return mode, value


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from elastiserve.kernels import attention, fp8_activations, l2_prefetch, nested_gemm, silu_mul, skinny_configs
    from elastiserve.platforms import current_platform

    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny CPU smoke runs: intra-op threads only add spin-wait on a shared machine
    overrides = [(nested_gemm.FP8_MIN_M_QUANTIZED_INPUT, args.fp8_min_rows_quantized),
                 (nested_gemm.FP8_MIN_M_QUANTIZED_LONG_INPUT, args.fp8_min_rows_quantized_long),
                 (nested_gemm.FP8_MIN_M, args.fp8_min_rows),
                 (silu_mul.SPLIT_QUANT_MAX_ROWS, args.split_quant_max_rows),
                 (fp8_activations.QUANT_SPLIT_ROWS, None if args.quant_split_rows is None
                  else tuple(args.quant_split_rows)),
                 (nested_gemm.SPLIT_K_MERGE, args.split_k_merge),
                 (l2_prefetch.L2_PREFETCH_SHARE, None if args.l2_prefetch is None else dict(args.l2_prefetch))]
    arch = current_platform().arch
    if args.skinny_plain_max_rows is not None:
        overrides.append((skinny_configs.SKINNY_MAX_M, dict(skinny_configs.SKINNY_MAX_M.get(arch, {}),
                                                     plain=args.skinny_plain_max_rows)))
    saved = [dict(table) for table, _ in overrides]
    attention_stages = attention.NUM_STAGES
    if args.attention_stages is not None:
        attention.NUM_STAGES = args.attention_stages
    for table, value in overrides:  # before any graph is captured: the routing is baked into them
        if value is not None:
            table[arch] = value
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)
        attention.NUM_STAGES = attention_stages
        for (table, _), before in zip(overrides, saved):
            table.clear()
            table.update(before)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    """Each part's result is written as soon as it exists, so a run cut short by a time limit keeps what it measured."""
    with tempfile.TemporaryDirectory() as workdir:
        args.model_dir = resolve_model(args.model, Path(workdir))
        result: dict[str, Any] = {"metadata": metadata(args)}
        t0 = time.perf_counter()
        steps = [("static-fp16 engine (roofline, fp16 reference)", ("roofline", "fast_full"),
                  lambda: result.update(run_fp16(args, args.batches))),
                 ("dps engine (fast vs full, switch)", ("fast_full", "switch"),
                  lambda: result.update(run_dps(args, args.batches))),
                 ("throughput per policy", ("throughput",), lambda: result.update(throughput=run_throughput(args)))]
        for title, parts, run in steps:
            if any(part in args.parts for part in parts):
                print(f"[{time.perf_counter() - t0:6.0f} s] {title}", flush=True)
                run()
                _write(args.out, result, t0)
    _write(args.out, result, t0)
    print(format_report(result))
    print(f"results: {args.out} ({result['wall_s']:.0f} s)")
    return result


def _write(out: Path, result: dict[str, Any], t0: float) -> None:
    result["wall_s"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_finite(result), indent=1) + "\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


if __name__ == "__main__":
    main()
    sys.exit(0)
