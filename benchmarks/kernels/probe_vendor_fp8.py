"""Fast mode through the vendor FP8 GEMM: is ``torch._scaled_mm`` on the upper plane faster than our Triton fp8 path?

The upper plane of an E4M3 (or E5M2) nested weight is itself an FP8 weight, row-major ``[N, K]``, so its transpose is
exactly the column-major operand cuBLASLt / hipBLASLt want, with no copy. This probe times, side by side in one run
and per (shape, M): cuBLAS fp16 (``torch.matmul``), ``_scaled_mm`` on pre-quantized per-tensor operands (its best
case), our fast mode as a model runs it (``nested_linear_op``, per-token quantization included), and the vendor route
our fast mode could take: our per-token quantizer, then ``_scaled_mm`` with row-wise scales on the upper plane (fp16
out, else bf16 out then a cast), for E4M3 and E5M2 planes. Each vendor result is checked against the pure-torch
reference of fast mode first; an unsupported combination is recorded with its error, not timed.

    python benchmarks/kernels/probe_vendor_fp8.py --out vendor_fp8.json [--shapes qkv down] [--m 16 64 256]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_nested_gemm import SHAPES, copies_for, graph_time_us

from elastiserve.kernels import formats, fp8_activations, nested_gemm
from elastiserve.kernels.formats import Nesting
from elastiserve.platforms import current_platform

M_DEFAULT = (16, 64, 128, 256, 512, 1024, 4096)


def planes(n: int, k: int, copies: int, nesting: Nesting):
    out = []
    for i in range(copies):
        w = (torch.randn(n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(i)) * 0.02).half()
        upper, lower = formats.split(w, nesting)
        out.append({"w": w, "upper": upper, "lower": lower})
    return out


def vendor_fast(x, upper, nesting: Nesting, out_dtype: torch.dtype):
    """Our per-token quantizer, then the vendor FP8 GEMM on the upper plane (row-wise scales)."""
    q, s = fp8_activations.quantize_per_token(x)
    w8, w_scale = formats.upper_as_fp8(upper, nesting)
    scale_b = torch.full((1, upper.shape[0]), w_scale, dtype=torch.float32, device=x.device)
    y = torch._scaled_mm(q, w8.t(), scale_a=s[:, None], scale_b=scale_b, out_dtype=out_dtype)
    return y if out_dtype == torch.float16 else y.to(torch.float16)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def probe_vendor(x, weights, nesting: Nesting) -> dict:
    """Check, then time, the vendor route for one nesting: fp16 out first, bf16-then-cast if fp16 is refused."""
    c = weights[0]
    ref = nested_gemm.nested_linear_ref(x, c["upper"], c["lower"], None, int(nesting), "fp8")
    for out_dtype in (torch.float16, torch.bfloat16):
        try:
            err = rel_err(vendor_fast(x, c["upper"], nesting, out_dtype), ref)
        except (RuntimeError, ValueError) as exc:
            last = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        us = graph_time_us([lambda c=c, dt=out_dtype: vendor_fast(x, c["upper"], nesting, dt) for c in weights])
        return {"us": us, "out_dtype": str(out_dtype), "rel_err_vs_ref": err}
    return {"error": last}


def time_baselines(x, e4m3, w8s, w_scales) -> dict[str, float]:
    x_scale = (x.abs().max().float() / 448).reshape(())
    x8 = (x.float() / x_scale).to(torch.float8_e4m3fn)
    return {
        "torch_fp16": graph_time_us([lambda c=c: torch.matmul(x, c["w"].t()) for c in e4m3]),
        "scaled_mm_pertensor": graph_time_us([
            lambda w8=w8, s=s: torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=s, out_dtype=torch.float16)
            for w8, s in zip(w8s, w_scales)]),
        "quantize_per_token": graph_time_us([lambda: fp8_activations.quantize_per_token(x)] * len(e4m3)),
        "ours_fast": graph_time_us([lambda c=c: nested_gemm.nested_linear_op(
            x, c["upper"], c["lower"], None, int(Nesting.E4M3), True) for c in e4m3]),
    }


def probe_shape(name: str, n: int, k: int, m_values) -> list[dict]:
    copies = copies_for(n * k * 2)
    weights = {nest: planes(n, k, copies, nest) for nest in (Nesting.E4M3, Nesting.E5M2)}
    e4m3 = weights[Nesting.E4M3]
    w8s = [(c["w"].float() / (c["w"].abs().max().float() / 448)).to(torch.float8_e4m3fn) for c in e4m3]
    w_scales = [(c["w"].abs().max().float() / 448).reshape(()) for c in e4m3]
    rows = []
    for m in m_values:
        x = torch.randn(m, k, device="cuda").half()
        times = time_baselines(x, e4m3, w8s, w_scales)
        vendor = {nest.name: probe_vendor(x, weights[nest], nest) for nest in (Nesting.E4M3, Nesting.E5M2)}
        row = {"shape": name, "N": n, "K": k, "M": m, "fast_mode": nested_gemm.fast_mode_for(m), "us": times,
               "vendor": vendor}
        fp16 = times["torch_fp16"]
        line = (f"{name:20s} M={m:5d} fp16 {fp16:7.1f} scaled_mm {times['scaled_mm_pertensor']:7.1f} "
                f"quant {times['quantize_per_token']:5.1f} ours_fast {times['ours_fast']:7.1f} "
                f"({fp16 / times['ours_fast']:.2f}x)")
        for nest, v in vendor.items():
            line += (f" vendor[{nest}] {v['us']:7.1f} ({fp16 / v['us']:.2f}x, err {v['rel_err_vs_ref']:.1e})"
                     if "us" in v else f" vendor[{nest}] {v['error']}")
        print(line, flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", default=["qkv", "o", "gate_up", "down"],
                        help="Llama-3.1-8B linear names")
    parser.add_argument("--m", nargs="+", type=int, default=list(M_DEFAULT))
    args = parser.parse_args(argv)
    platform = current_platform()
    print(f"device {torch.cuda.get_device_name()} arch {platform.arch} torch {torch.__version__}", flush=True)
    rows = []
    for short in args.shapes:
        name = f"llama3.1-8b.{short}"
        n, k = SHAPES[name]
        rows += probe_shape(name, n, k, args.m)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "arch": platform.arch, "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
