"""One-shot GPU probe: where the exact-top head's time goes, each step of ``exact_top_logits`` timed alone.

Why: the nested lm_head with its 16 largest logits a row exact (``--lm-head-exact-top 16``) cost 3.9 % of the batch-1
fast decode step over the FP8 head on an H100 in session 43 (3.180 against 3.062 ms, Llama-3.1-8B), with the gather,
merge and dot already one ``elastiserve::exact_rows`` launch: about as much as the dozen torch ops it replaced
(3.4 %, session 39). The steps: the top-k over 128,256 logits (``torch.topk`` against the two chunked launches of
``elastiserve::top_k_indices`` at several chunk sizes and warp counts), ``exact_rows`` (at several picked rows a
program: at batch 1 its default of 16 is one program for the whole 128 KB), and the scatter; the fast head GEMM
beside them for scale.

Logits stay where the head wrote them (L2-sized at these batches, as in a decode step); the picked weight rows are
drawn from a 1.05 GB head, so they come from HBM. Each timing is one CUDA graph over 8 logits tensors (8 pick sets),
replayed 20 times.

    python benchmarks/kernels/probe_exact_top.py --out exact_top.json [--batch 1 8 32] [--top 16 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nested_gemm import graph_time_us

from elastiserve.kernels import formats, top_k
from elastiserve.kernels.exact_rows import exact_rows, exact_rows_op
from elastiserve.kernels.formats import Nesting
from elastiserve.kernels.nested_gemm import nested_linear_op
from elastiserve.kernels.nested_linear import exact_top_logits
from elastiserve.kernels.top_k import top_k_indices
from elastiserve.platforms import current_platform

VOCAB, HIDDEN = 128256, 4096  # Llama-3.1-8B's lm_head
PICK_SETS = 8
BLOCK_TS = (16, 4, 2, 1)
# top_k_indices' (CHUNK, CHUNK_WARPS, LAST_STEP_WARPS): the first is the shipped one
TOP_K_SETTINGS = ((1024, 1, 4), (1024, 1, 1), (1024, 4, 4), (2048, 1, 4), (2048, 2, 4), (4096, 4, 8))


@contextmanager
def top_k_setting(chunk: int, chunk_warps: int, last_warps: int):
    """top_k_indices with another chunk size and warp counts, put back afterwards (also when the body raises)."""
    saved = top_k.CHUNK, top_k.CHUNK_WARPS, top_k.LAST_STEP_WARPS
    top_k.CHUNK, top_k.CHUNK_WARPS, top_k.LAST_STEP_WARPS = chunk, chunk_warps, last_warps
    try:
        yield
    finally:
        top_k.CHUNK, top_k.CHUNK_WARPS, top_k.LAST_STEP_WARPS = saved


def _head():
    w = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 0.02).half()
    upper, lower = formats.split(w, Nesting.E4M3)
    del w
    return upper, lower


def _with_torch_topk(x, approx, upper, lower, top):
    picked = approx.topk(top, dim=-1, sorted=False).indices
    exact = exact_rows_op(x, picked, upper, lower, None, int(Nesting.E4M3), 0)
    return approx.scatter(-1, picked, exact)


def _same_values(logits: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> bool:
    """The picked positions hold the same multiset of logits (ties may pick other positions)."""
    return bool(torch.equal(logits.gather(-1, got).sort(-1).values, logits.gather(-1, want).sort(-1).values))


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
        "exact_top_torch_topk": [lambda x=x, lg=lg: _with_torch_topk(x, lg, upper, lower, top) for x, lg in
                                 zip(xs, logits)],
        "exact_top_chunked": [lambda x=x, lg=lg: exact_top_logits(x, lg, upper, lower, None, Nesting.E4M3, 0, top)
                              for x, lg in zip(xs, logits)],
    }
    for block_t in BLOCK_TS:
        calls[f"exact_rows_bt{block_t}"] = [
            lambda x=x, p=p, bt=block_t: exact_rows(x, p, upper, lower, None, Nesting.E4M3, block_t=bt)
            for x, _, p, _ in pairs]
    row = {"batch": batch, "top": top, "us": {name: graph_time_us(fns) for name, fns in calls.items()}}
    row["chunked_same_values"] = True
    for setting in TOP_K_SETTINGS:
        with top_k_setting(*setting):
            name = "topk_chunked_{}_w{}_w{}".format(*setting)
            row["us"][name] = graph_time_us([lambda lg=lg: top_k_indices(lg, top) for lg in logits])
            row["chunked_same_values"] &= all(_same_values(lg, top_k_indices(lg, top), p)
                                              for lg, p in zip(logits, picks))
    row["us"]["topk_chunked"] = row["us"]["topk_chunked_{}_w{}_w{}".format(*TOP_K_SETTINGS[0])]
    row["block_t_same_bytes"] = all(
        torch.equal(exact_rows(x, p, upper, lower, None, Nesting.E4M3, block_t=bt), e)
        for x, _, p, e in pairs for bt in BLOCK_TS)
    us = row["us"]
    print(f"batch {batch:3d} top {top:2d}: head {us['head_fast']:7.1f} us | topk torch {us['topk_torch']:6.1f} "
          f"chunked {us['topk_chunked']:6.1f} (best setting " + min(
              (n for n in us if n.startswith("topk_chunked_")), key=us.get) + ") | exact_rows " + " ".join(
              f"bt{bt} {us[f'exact_rows_bt{bt}']:5.1f}" for bt in BLOCK_TS) +
          f" | scatter {us['scatter']:5.1f} | whole: torch topk {us['exact_top_torch_topk']:6.1f} chunked "
          f"{us['exact_top_chunked']:6.1f} | same values {row['chunked_same_values']} same bytes "
          f"{row['block_t_same_bytes']}", flush=True)
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
    rows = [probe(b, t, upper, lower) for t in args.top for b in args.batch]
    result = {"device": torch.cuda.get_device_name(0), "arch": current_platform().arch, "torch": torch.__version__,
              "timing": "CUDA graph replay over 8 logits / pick sets, 20 replays; picked rows from a 1.05 GB head",
              "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all(r["chunked_same_values"] and r["block_t_same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
