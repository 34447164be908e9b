"""One-shot GPU probe: fast mode's activation quantizers on rows longer than 4,096 values, each route side by side.

Why: on the H200 the down GEMM at 256 rows ran 50.9 us in fast mode with its 14,336-wide rows quantized in the op
against 34.8 us on rows quantized beforehand (session 37, h200-nested-gemm-s37.json). ``quantize_per_token`` gives
such rows one 4-warp program each above 128 rows (8 warps a SM at 256 rows, each walking its row twice); the split
route (``fp8_activations.QUANT_SPLIT_ROWS``) spreads a row over 1,024-wide programs in two launches. The quantizing
SiLU-and-mul splits only up to 32 rows (``silu_mul.SPLIT_QUANT_MAX_ROWS``) and holds a whole row in one program
up to 128.

Routes per (op, rows, K): ``unsplit`` (one program a row at every row count: sm90's tables before session 39, which
then split ``quantize_per_token`` at 2-256 rows), ``split`` (the split route at every row count).
Every route must write the same bytes; a route that does not is reported and never the best. Each timing is one CUDA
graph over enough input copies to pass 400 MB (so rows come from HBM, as a layer's activations after a GEMM do not
always), replayed 20 times.

    python benchmarks/kernels/probe_quantizer.py --out quant.json [--rows 16 64 256 1024] [--k 12288 14336]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nested_gemm import ROTATE_BYTES, graph_time_us

from elastiserve.kernels import fp8_activations, silu_mul
from elastiserve.platforms import current_platform

ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
KS = (12288, 14336)  # Qwen3-8B's and Llama-3.1-8B's down_proj inputs
SILU_MAX_ROWS = 1024  # gate_up rows are twice as wide: 4,096 rows of 2 x 14,336 is 470 MB a copy
ROUTES = ("unsplit", "split")


@contextmanager
def route(name: str):
    """The quantizers' routing tables for one route, put back afterwards (also when the body raises)."""
    arch = current_platform().arch
    saved = dict(fp8_activations.QUANT_SPLIT_ROWS), dict(silu_mul.SPLIT_QUANT_MAX_ROWS)
    if name == "split":
        fp8_activations.QUANT_SPLIT_ROWS[arch] = (1, 1 << 30)
        silu_mul.SPLIT_QUANT_MAX_ROWS[arch] = 1 << 30
    elif name == "unsplit":
        fp8_activations.QUANT_SPLIT_ROWS[arch] = (1, 0)
        silu_mul.SPLIT_QUANT_MAX_ROWS[arch] = 0
    else:
        raise ValueError(f"unknown route {name!r}; choose from {ROUTES}")
    try:
        yield
    finally:
        fp8_activations.QUANT_SPLIT_ROWS.clear()
        fp8_activations.QUANT_SPLIT_ROWS.update(saved[0])
        silu_mul.SPLIT_QUANT_MAX_ROWS.clear()
        silu_mul.SPLIT_QUANT_MAX_ROWS.update(saved[1])


def _copies(rows: int, width: int) -> list[torch.Tensor]:
    count = max(2, math.ceil(ROTATE_BYTES / (rows * width * 2)))
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + width)
    return [(torch.randn(rows, width, device="cuda", generator=gen) * 4).half() for _ in range(count)]


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return bool(torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1]))


def probe(op: str, rows: int, k: int) -> dict:
    inputs = _copies(rows, 2 * k if op == "silu_and_mul_quant" else k)
    fn = {"quantize_per_token": lambda x: fp8_activations.quantize_per_token(x),
          "silu_and_mul_quant": lambda x: silu_mul.silu_and_mul_quant(x, False)}[op]
    want = None
    row = {"op": op, "rows": rows, "k": k, "copies": len(inputs), "us": {}, "bytes_equal": {}}
    for name in ROUTES:
        with route(name):
            got = fn(inputs[0])
            want = want or got
            row["bytes_equal"][name] = _same(got, want)
            row["us"][name] = graph_time_us([lambda x=x: fn(x) for x in inputs])
    row["split_over_unsplit"] = row["us"]["unsplit"] / row["us"]["split"]
    print(f"{op:20s} rows {rows:5d}  K {k:5d}  unsplit {row['us']['unsplit']:7.2f} us  split "
          f"{row['us']['split']:7.2f} us  ({row['split_over_unsplit']:.2f}x)  bytes equal: "
          f"{all(row['bytes_equal'].values())}", flush=True)
    del inputs
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--k", type=int, nargs="*", default=list(KS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this probe needs a GPU", file=sys.stderr)
        return 2
    rows = [probe("quantize_per_token", m, k) for k in args.k for m in args.rows]
    rows += [probe("silu_and_mul_quant", m, k) for k in args.k for m in args.rows if m <= SILU_MAX_ROWS]
    result = {"device": torch.cuda.get_device_name(0), "arch": current_platform().arch, "torch": torch.__version__,
              "timing": f"CUDA graph replay, inputs rotated over >= {ROTATE_BYTES >> 20} MB", "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all(all(r["bytes_equal"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
