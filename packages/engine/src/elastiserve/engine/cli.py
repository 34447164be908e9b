"""``elastiserve`` command line: ``serve``, ``generate``, ``bench`` and ``demo``.

    elastiserve serve smollm2 --device cpu --port 8000 --policy combined --kv-cache-budget 20MiB
    elastiserve generate smollm2 --input prompts.jsonl --output out.jsonl
    elastiserve bench smollm2 --policy static-fp16 --policy dps --workload gamma --rate 1 --rate 2 --out results/
    elastiserve demo
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import Any

from elastiserve.platforms import ConfigError

log = logging.getLogger("elastiserve.cli")

POLICIES = ("static-fp16", "static-fp8", "dps", "elastickv", "combined")
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def port_number(text: str) -> int:
    """``--port``: 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0-65535")
    return port


def parse_size(text: str) -> int:
    """Bytes from "80GB" (decimal), "20GiB" (binary), "512MiB", "1.5G" (decimal) or a plain byte count."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"cannot parse size {text!r}: expected e.g. 80GB, 20GiB, 512MiB, 1048576")
    number, prefix, binary, _ = match.groups()
    if binary and not prefix:
        raise argparse.ArgumentTypeError(f"cannot parse size {text!r}: 'i' needs a prefix (KiB, MiB, GiB, TiB)")
    base = 1024 if binary else 1000
    return int(float(number) * base ** _POWERS[prefix.lower()])


# vLLM's --dtype spellings that mean what every policy computes in: fp16 (bf16 checkpoints are cast at load, exactly
# where their values fit). Others are refused with the reason rather than silently served in another type.
DTYPE_SPELLINGS = {"auto": "float16", "half": "float16", "float16": "float16"}
KV_CACHE_DTYPES = ("auto", "fp16", "float16")


def parse_dtype(text: str) -> str:
    if text in DTYPE_SPELLINGS:
        return DTYPE_SPELLINGS[text]
    raise argparse.ArgumentTypeError(f"--dtype {text}: elastiserve computes in float16 ({', '.join(DTYPE_SPELLINGS)});"
                                     " bf16 checkpoints are cast to fp16 at load")


def parse_kv_cache_dtype(text: str) -> str:
    if text in KV_CACHE_DTYPES:
        return text
    raise argparse.ArgumentTypeError(f"--kv-cache-dtype {text}: the KV cache is fp16 ({', '.join(KV_CACHE_DTYPES)}); "
                                     "under pressure --policy elastickv or combined demotes pairs of blocks to their "
                                     "high byte (E5M2) and promotes them back exactly")


def add_engine_args(p: argparse.ArgumentParser, *, model_required: bool = True) -> None:
    if model_required:
        p.add_argument("model", help="model directory, 'smollm2', or a built-in config name with --load-format dummy")
    p.add_argument("--policy", default="static-fp16", choices=POLICIES)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--dtype", type=parse_dtype, default="float16", help="auto, half or float16 (vLLM's spellings)")
    p.add_argument("--kv-cache-dtype", type=parse_kv_cache_dtype, default="auto",
                   help="auto or fp16: KV is fp16, demoted to E5M2 pairs only by the elastic policies")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--gpu-memory-budget", type=parse_size, default=None, help="absolute cap, e.g. 80GB")
    p.add_argument("--kv-cache-budget", type=parse_size, default=None, help="KV pool bytes, e.g. 20GiB")
    p.add_argument("--host-backing-budget", dest="host_backing_bytes", type=parse_size, default=None,
                   help="pinned host memory for demoted pairs' low bytes (default: as large as the KV pool; less "
                        "caps how many pairs can be BASE)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "gguf", "dummy"))
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--graph-capture-after", type=int, default=8,
                   help="capture a decode graph first needed mid-run (a per-layer precision mix) at its Nth use; "
                        "until then that step runs eagerly (1: capture at first use)")
    p.add_argument("--mixed-graphs", action="store_true",
                   help="replay CUDA graphs for steps that carry prefill chunks too (padded to token buckets)")
    p.add_argument("--max-step-time", dest="max_step_time_s", type=float, default=None,
                   help="seconds: cut prefill chunks so that a step takes at most this long in the current precision "
                        "mode, learned from recent steps (e.g. under a TBT SLO)")
    p.add_argument("--queue-fast-after", dest="queue_fast_after_s", type=float, default=None,
                   help="seconds (dps, combined): run every layer in FP8 while a request has waited this long for "
                        "its first token, residuals kept (back to full with no restore)")
    p.add_argument("--queue-fast-hold", dest="queue_fast_hold_s", type=float, default=None,
                   help="seconds: with --queue-fast-after, stay fast this long after the last step that saw a "
                        "waiting request (default 2)")
    p.add_argument("--prefill-fast", action="store_true",
                   help="dps, combined: steps that carry a prefill chunk run every layer in FP8, residuals kept")
    p.add_argument("--nest-lm-head", action="store_true",
                   help="nested policies: lm_head in nested planes too, read in FP8 while every layer runs fast "
                        "(its logits then move; off by default)")
    p.add_argument("--lm-head-exact-top", dest="lm_head_exact_top", type=int, default=0,
                   help="with --nest-lm-head: recompute this many of the largest logits a row from the head's exact "
                        "fp16 rows in fast mode (its lower plane then stays resident); 0: off")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the KV of prompt prefixes (whole pairs of blocks) that earlier requests computed")
    p.add_argument("--no-gc-shadow", dest="gc_in_step_shadow", action="store_false",
                   help="leave garbage collection automatic (by default, on a GPU, its passes run while the device "
                        "computes a step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="priority: requests' 'priority' (lower first) orders the queue and picks preemption victims")
    p.add_argument("--cpu-kv-blocks", type=int, default=512, help="KV pool size in blocks on the CPU")


ENGINE_FIELDS = ("device", "dtype", "block_size", "gpu_memory_utilization", "gpu_memory_budget", "kv_cache_budget",
                 "host_backing_bytes", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "tensor_parallel_size", "load_format", "enforce_eager", "graph_capture_after", "mixed_graphs",
                 "max_step_time_s", "queue_fast_after_s", "queue_fast_hold_s", "prefill_fast", "nest_lm_head",
                 "lm_head_exact_top", "enable_prefix_caching", "gc_in_step_shadow",
                 "seed", "cpu_kv_blocks", "scheduling_policy")


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in ENGINE_FIELDS}


def make_engine(model: str, policy: str, settings: dict[str, Any]) -> Any:
    from elastiserve.engine.config import EngineConfig
    from elastiserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, policy=policy, **settings))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastiserve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port_number, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"), default=None,
                       help="chat answers' <think> text goes to reasoning_content, the rest to content")
    serve.add_argument("--generation-config", default="auto", help="default sampling values: 'auto' (the model's "
                       "generation_config.json, as vLLM applies it), 'none' (OpenAI's), or a folder or file")
    serve.add_argument("--chat-template", default=None, help="a Jinja chat template file (or the template itself) "
                       "to use instead of the model's")

    gen = sub.add_parser("generate", help="offline batch generation from a JSONL file")
    add_engine_args(gen)
    gen.add_argument("--input", type=Path, required=True,
                     help='JSONL, one request a line: {"prompt": ...}, {"messages": [...]} or '
                          '{"prompt_token_ids": [...]}, with any sampling field (with n > 1 a row holds "choices")')
    gen.add_argument("--output", type=Path, required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--chat-template", default=None, help="as serve's, for the lines that hold messages")

    from elastiserve.engine.bench.cli_args import add_bench_args

    bench = sub.add_parser("bench", help="replay a workload in-process or against a server; JSON + plots")
    add_bench_args(bench)
    add_engine_args(bench, model_required=False)

    demo = sub.add_parser("demo", help="SmolLM2 on the CPU: every policy on a small bursty trace window, one table")
    demo.add_argument("--out", type=Path, default=Path("elastiserve-demo"))
    demo.add_argument("--count", type=int, default=None, help="requests in the trace window")
    demo.add_argument("--policy", dest="policies", action="append", choices=POLICIES, default=None)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from elastiserve.engine.async_engine import AsyncEngine
    from elastiserve.engine.server import build_app, listen_sockets, run_forever

    socks = listen_sockets(args.host, args.port)  # a port in use stops here, before the model loads
    try:
        engine = make_engine(args.model, args.policy, engine_settings(args))
        use_chat_template(engine, args.chat_template)
        defaults = serving_defaults(engine, args)
        async_engine = AsyncEngine(engine).start()
        try:
            app = build_app(async_engine, engine.tokenizer, model_name=args.served_model_name or args.model,
                            api_key=args.api_key, reasoning_parser=args.reasoning_parser, default_sampling=defaults)
            run_forever(app, socks)
        finally:
            async_engine.shutdown()
    finally:
        for sock in socks:
            sock.close()
    return 0


def use_chat_template(engine: Any, value: str | None) -> None:
    """``--chat-template``: replace the model's template (checked before serving: a bad one stops the start)."""
    if value is None:
        return
    from elastiserve.engine.chat_render import load_chat_template

    try:
        if engine.tokenizer is None:
            raise ConfigError("--chat-template needs a model with a tokenizer")
        engine.tokenizer.set_chat_template(load_chat_template(value))
    except ConfigError:
        engine.close()  # the engine holds device memory and workers; the command stops here
        raise


def serving_defaults(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``--generation-config``'s sampling defaults, said aloud when the model's file changes OpenAI's."""
    from elastiserve.engine.generation_defaults import generation_defaults
    from elastiserve.engine.loader import resolve_model_dir

    try:
        defaults = generation_defaults(args.generation_config, resolve_model_dir(args.model, args.load_format))
    except ConfigError:
        engine.close()
        raise
    if defaults:
        log.warning("default sampling values from %s's generation config (a request's own win; "
                    "--generation-config none keeps OpenAI's): %s", args.model, defaults)
    return defaults


def cmd_generate(args: argparse.Namespace) -> int:
    from elastiserve.engine.generate_input import read_generate_input
    from elastiserve.engine.generate_run import run_generate

    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k}
    lines = read_generate_input(args.input, defaults)  # the whole file is checked before the model loads
    engine = make_engine(args.model, args.policy, engine_settings(args))
    use_chat_template(engine, args.chat_template)
    try:
        rows = run_generate(engine, lines, str(args.input), args.output)
    finally:
        engine.close()  # VMM units and, with tensor parallelism, the worker processes
    print(f"wrote {rows} rows to {args.output}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from elastiserve.engine.bench.cli_args import run_from_args

    return run_from_args(args, make_engine, engine_settings(args))


def cmd_demo(args: argparse.Namespace) -> int:
    from elastiserve.engine.bench.demo import run_demo

    print(run_demo(args.out, count=args.count, policies=tuple(args.policies or POLICIES)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers = {"serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench, "demo": cmd_demo}
    try:
        return handlers[args.command](args)
    except ConfigError as exc:
        print(f"elastiserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
