"""One-shot GPU probe: where the exact-top head's time goes, each step of ``exact_top_logits`` timed alone.

Why: the nested lm_head with its 16 largest logits a row exact (``--lm-head-exact-top 16``) cost 3.9 % of the batch-1
fast decode step over the FP8 head on an H100 in session 43 (3.180 against 3.062 ms, Llama-3.1-8B), with the gather,
merge and dot already one ``elastiserve::exact_rows`` launch: about as much as the dozen torch ops it replaced
(3.4 %, session 39), and with torch.topk swapped for a two-launch chunked top-k in another call (3abd2a9: +80 to
+143 us against +85 to +118, no gain). So the probe times each step alone: the top-k over 128,256 logits
(``torch.topk``), ``exact_rows`` at 16 / 4 / 2 / 1 picked rows a program and K tiles of 256 / 1,024 / 4,096 (at
batch 1 its default, 16 rows and 256, is one program walking the whole 128 KB in 16 dependent tiles), the scatter,
and the whole step; the fast head GEMM beside them for
scale. The whole step costs about the same ~100 us at batch 1 and at 32, which points at a fixed latency (one
program's K loop) rather than at bytes.

Logits stay where the head wrote them (L2-sized at these batches, as in a decode step); the picked weight rows are
drawn from a 1.05 GB head, so they come from HBM. Each timing is one CUDA graph over 8 logits tensors (8 pick sets),
replayed 20 times.

    python benchmarks/kernels/probe_exact_top.py --out exact_top.json [--batch 1 8 32] [--top 16 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nested_gemm import graph_time_us

from elastiserve.kernels import formats
from elastiserve.kernels.exact_rows import exact_rows
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.nested_gemm import nested_linear_op
from elastiserve.kernels.nested_linear import exact_top_logits
from elastiserve.platforms import current_platform

VOCAB, HIDDEN = 128256, 4096  # Llama-3.1-8B's lm_head
PICK_SETS = 8
# exact_rows' (picked rows a program, K tile): the shipped one first, then more programs a token and longer K tiles
# (fewer dependent loads a program: 4 at 1,024, 1 at 4,096)
LAUNCHES = ((16, 256), (4, 256), (2, 256), (1, 256), (4, 1024), (1, 1024), (1, 4096))


def _head():
    w = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 0.02).half()
    upper, lower = formats.split(w, Nesting.E4M3)
    del w
    return upper, lower


def _agree(got: torch.Tensor, want: torch.Tensor, same_tile: bool) -> bool:
    if same_tile:
        return bool(torch.equal(got, want))
    ulp = torch.finfo(torch.float16).eps * want.float().abs().clamp_min(2.0**-14)  # one fp16 step, within 2x
    return bool(((got.float() - want.float()).abs() <= ulp).all())


def probe(batch: int, top: int, upper: torch.Tensor, lower: torch.Tensor) -> dict:
    gen = torch.Generator("cuda").manual_seed(batch * 100 + top)
    xs = [torch.randn(batch, HIDDEN, device="cuda", generator=gen).half() for _ in range(PICK_SETS)]
    logits = [nested_linear_op(x, upper, lower, None, int(Nesting.E4M3), True, 0) for x in xs]
    picks = [lg.topk(top, dim=-1, sorted=False).indices for lg in logits]
    exacts = [exact_rows(x, p, upper, lower, None, Nesting.E4M3) for x, p in zip(xs, picks)]
    pairs = list(zip(xs, logits, picks, exacts))
    calls = {
        "head_fast": [lambda x=x: nested_linear_op(x, upper, lower, None, int(Nesting.E4M3), True, 0) for x in xs],
        "topk_torch": [lambda lg=lg: lg.topk(top, dim=-1, sorted=False) for lg in logits],
        "scatter": [lambda lg=lg, p=p, e=e: lg.scatter(-1, p, e) for _, lg, p, e in pairs],
        "exact_top": [lambda x=x, lg=lg: exact_top_logits(x, lg, upper, lower, None, Nesting.E4M3, 0, top)
                      for x, lg in zip(xs, logits)],
    }
    for bt, bk in LAUNCHES:
        calls[f"exact_rows_t{bt}_k{bk}"] = [
            lambda x=x, p=p, bt=bt, bk=bk: exact_rows(x, p, upper, lower, None, Nesting.E4M3, block_t=bt, block_k=bk)
            for x, _, p, _ in pairs]
    row = {"batch": batch, "top": top, "us": {name: graph_time_us(fns) for name, fns in calls.items()}}
    # every launch against the shipped one: the same bytes at the same K tile, one fp16 rounding apart otherwise
    row["launches_agree"] = all(
        _agree(exact_rows(x, p, upper, lower, None, Nesting.E4M3, block_t=bt, block_k=bk), e, bk == LAUNCHES[0][1])
        for x, _, p, e in pairs for bt, bk in LAUNCHES)
    us = row["us"]
    print(f"batch {batch:3d} top {top:2d}: head {us['head_fast']:7.1f} us | topk {us['topk_torch']:6.1f} | "
          "exact_rows (rows, K tile) " + " ".join(f"{bt},{bk} {us[f'exact_rows_t{bt}_k{bk}']:5.1f}"
                                                  for bt, bk in LAUNCHES) +
          f" | scatter {us['scatter']:5.1f} | whole step {us['exact_top']:6.1f} | agree {row['launches_agree']}",
          flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--top", type=int, nargs="*", default=[16, 64])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("this probe needs a GPU", file=sys.stderr)
        return 2
    upper, lower = _head()
    print(f"head planes built; timing batches {args.batch} x top {args.top} (each compiles its kernels first)",
          flush=True)
    rows = [probe(b, t, upper, lower) for t in args.top for b in args.batch]
    result = {"device": torch.cuda.get_device_name(0), "arch": current_platform().arch, "torch": torch.__version__,
              "timing": "CUDA graph replay over 8 logits / pick sets, 20 replays; picked rows from a 1.05 GB head",
              "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all(r["launches_agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
