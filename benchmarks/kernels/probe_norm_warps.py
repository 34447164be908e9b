"""One-shot GPU probe: the decode step's fused add + RMSNorm, plain (full mode) and quantizing (fast mode), at 4, 8
and 16 warps a program (``rms_norm._num_warps`` gives 4 plain and 16 quantizing at Llama-8B's 4,096 columns).

Why: at batch 1 the quantizing norms cost 35 us a step more than the plain ones on the H200 (session 21's PDL-off
profile, 65 calls), more than the 26 us batch-1 fast mode is short of 1.6x full. One program holds the row; the
quantizing one reduces twice (sum of squares, then the maximum for the scale), each across all its warps.

Each (rows, warps, op) is 64 calls on separate rows captured in one CUDA graph (PDL as the platform launches it),
replayed; the row bytes stay in L2, as a decode step's do. Also recorded: whether the quantizing norm's bytes still
equal ``quantize_per_token`` of the plain norm at the default warps (the engine's fp8 rows promise that).

    python benchmarks/kernels/probe_norm_warps.py --out norm.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nested_gemm import graph_time_us

from elastiserve.kernels.fp8_activations import quantize_per_token

rms_norm = importlib.import_module("elastiserve.kernels.rms_norm")  # the package exports the op under this name

HIDDEN = 4096
ROWS = (1, 2, 4)
WARPS = (4, 8, 16)
CALLS = 64
EPS = 1e-5


def _inputs(rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: (torch.randn(*shape, generator=gen) * 3).half().cuda()  # noqa: E731
    return [(make(rows, HIDDEN), make(rows, HIDDEN)) for _ in range(CALLS)], make(HIDDEN) / 3 + 1


def _with_warps(warps: int | None, fn):
    default = rms_norm._num_warps
    if warps is not None:  # the launcher's rule, replaced for this probe only
        rms_norm._num_warps = lambda block, quant=False: warps
    try:
        return fn()
    finally:
        rms_norm._num_warps = default


def probe(rows: int) -> list[dict]:
    pairs, weight = _inputs(rows, rows)
    x, residual = pairs[0]
    plain_default = rms_norm.fused_add_rms_norm(x, residual, weight, EPS)[0]
    want_q, want_scale = quantize_per_token(plain_default)
    plain = [lambda p=p: rms_norm.fused_add_rms_norm(*p, weight, EPS) for p in pairs]
    quant = [lambda p=p: rms_norm.fused_add_rms_norm_quant(*p, weight, EPS, False) for p in pairs]
    out = []
    for warps in WARPS:
        q, scale, _ = _with_warps(warps, lambda: rms_norm.fused_add_rms_norm_quant(x, residual, weight, EPS, False))
        same = bool(torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale))
        row = {"rows": rows, "warps": warps, "plain_us": _with_warps(warps, lambda: graph_time_us(plain)),
               "quant_us": _with_warps(warps, lambda: graph_time_us(quant)), "quant_bytes_equal_default": same}
        print(f"rows {rows}  warps {warps:2d}  plain {row['plain_us']:5.2f} us  quantizing {row['quant_us']:5.2f} us"
              f"  bytes as the default plain norm + quantizer: {same}", flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this probe needs a GPU", file=sys.stderr)
        return 2
    rows = [row for m in ROWS for row in probe(m)]
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "hidden": HIDDEN,
              "calls_per_graph": CALLS, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
