"""Decode attention over the paged, mixed-fidelity KV cache, and pair demotion, on the GPU.

Side by side, every case replayed from a CUDA graph with the KV rotated across layers (each layer's KV is far
larger than the 60 MB L2): SDPA on contiguous KV, the native path, all-BASE, structured at ~15 % BASE
(TARGET-BASE-TARGET), the same layout through the general path, and ``kv_demote`` against a device-to-device copy
(bytes read + written). Prints a table and writes JSON with the device and versions.

    python benchmarks/kernels/bench_attention.py --out attention.json
    python benchmarks/kernels/bench_attention.py --batch 1 --context 512 --table-tokens 8192 --out short.json

``--table-tokens``: block tables (and so the op's KV split count) sized for that many tokens, as in a decode graph
captured for the longest context, while the sequences hold ``--context``: batch-1 decode at 512 tokens in a graph
for 8,192 runs 16 splits of which 8 hold pairs (the split merge's case).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton

from elastiserve.kernels import attention as attention_mod
from elastiserve.kernels.attention import paged_attention
from elastiserve.kernels.kv_ops import kv_demote


@dataclass(frozen=True)
class DecodeShape:
    batch: int = 64
    context: int = 4096
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    layers: int = 4  # rotation depth: each layer's KV is read once per graph replay
    base_fraction: float = 0.15
    table_tokens: int = 0  # block-table width in tokens (0: the context)


@dataclass
class Row:
    case: str
    us: float
    p20_us: float
    p80_us: float
    kv_bytes: int
    tb_per_s: float
    note: str = ""


def graph_time_us(fn_per_layer, layers: int, replays: int = 20, trials: int = 7) -> tuple[float, float, float]:
    """Capture one graph that calls fn(layer) for every layer; time replays with CUDA events, per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in range(layers):
            fn_per_layer(layer)  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn_per_layer(layer)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / (replays * layers))
    samples.sort()
    q = statistics.quantiles(samples, n=5)
    return statistics.median(samples), q[0], q[3]


def build_tables(shape: DecodeShape, device):
    blocks_per_seq = shape.context // shape.block_size
    table_blocks = max(shape.table_tokens, shape.context) // shape.block_size
    num_blocks = shape.batch * table_blocks
    gen = torch.Generator().manual_seed(0)
    physical = torch.randperm(num_blocks, generator=gen).view(shape.batch, table_blocks).int()
    native = physical.clone()
    all_base = physical.clone()
    all_base[:, 1::2] = all_base[:, 0::2]
    num_pairs = blocks_per_seq // 2
    base_pairs = max(1, round(shape.base_fraction * num_pairs))
    starts = torch.randint(num_pairs // 4, num_pairs - base_pairs - num_pairs // 8, (shape.batch,), generator=gen)
    bounds = torch.stack([starts, starts + base_pairs], dim=1).int()
    mixed = physical.clone()
    pair_mode = torch.zeros(shape.batch, num_pairs, dtype=torch.uint8)
    for seq in range(shape.batch):
        first, end = int(bounds[seq, 0]), int(bounds[seq, 1])
        mixed[seq, 2 * first + 1 : 2 * end : 2] = mixed[seq, 2 * first : 2 * end : 2]
        pair_mode[seq, first:end] = 1
    to = dict(device=device)
    return num_blocks, native.to(**to), all_base.to(**to), mixed.to(**to), bounds.to(**to), pair_mode.to(**to)


def bench_decode(shape: DecodeShape, device, num_splits: int = 0, cases: tuple[str, ...] | None = None) -> list[Row]:
    """Every decode case side by side (``cases``: only those named)."""
    num_blocks, native, all_base, mixed, bounds, pair_mode = build_tables(shape, device)
    cache = torch.randn(
        num_blocks, shape.layers, 2, shape.kv_heads, shape.block_size, shape.head_dim, device=device
    ).half()  # fmt: skip
    q = torch.randn(shape.batch, shape.q_heads, shape.head_dim, device=device).half()
    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    qsl = torch.arange(shape.batch + 1, dtype=torch.int32, device=device)
    scale = shape.head_dim**-0.5
    kv_bytes = shape.batch * shape.context * shape.kv_heads * shape.head_dim * 2 * 2
    rows = []

    def paged(table, path, bounds=None, modes=None):
        def call(layer):
            paged_attention(
                q, cache, layer, table, seq_lens, qsl, base_bounds=bounds, pair_mode=modes, scale=scale,
                max_query_len=1, path=path, num_splits=num_splits,
            )  # fmt: skip

        return call

    keys = torch.randn(shape.layers, shape.batch, shape.kv_heads, shape.context, shape.head_dim, device=device).half()
    values = torch.randn_like(keys)
    q_sdpa = q.view(shape.batch, shape.q_heads, 1, shape.head_dim)

    def sdpa(layer):
        F.scaled_dot_product_attention(q_sdpa, keys[layer], values[layer], scale=scale, enable_gqa=True)

    base_share = float((bounds[:, 1] - bounds[:, 0]).sum()) * 2 * shape.block_size / (shape.batch * shape.context)
    every_case = [
        ("sdpa_contiguous", sdpa, kv_bytes, ""),
        ("native", paged(native, 0), kv_bytes, "path 0"),
        ("all_base", paged(all_base, 1, torch.tensor([[0, 1 << 30]] * shape.batch, dtype=torch.int32, device=device)),
         kv_bytes // 2, "path 1, every pair BASE"),
        ("structured_15", paged(mixed, 1, bounds), int(kv_bytes * (1 - base_share / 2)),
         f"path 1, {base_share:.1%} of tokens BASE"),
        ("general_15", paged(mixed, 2, modes=pair_mode), int(kv_bytes * (1 - base_share / 2)), "path 2, same layout"),
        ("all_base_split", paged(all_base, 3, torch.tensor([[0, 1 << 30]] * shape.batch, dtype=torch.int32,
                                                           device=device)), kv_bytes // 2, "path 3, every pair BASE"),
        ("structured_15_split", paged(mixed, 3, bounds), int(kv_bytes * (1 - base_share / 2)),
         "path 3 (two launches), same layout as structured_15"),
    ]  # fmt: skip
    for name, fn, nbytes, note in every_case:
        if cases is not None and name not in cases:
            continue
        med, p20, p80 = graph_time_us(fn, shape.layers)
        rows.append(Row(name, med, p20, p80, nbytes, nbytes / med / 1e6, note))
    return rows


def bench_demote(shape: DecodeShape, device, pairs: int = 2048) -> list[Row]:
    layers = 32  # one block spans every layer: a Llama-3.1-8B-like 2 MiB block
    cache = torch.randn(2 * pairs + 1, layers, 2, shape.kv_heads, shape.block_size, shape.head_dim, device=device)
    cache = cache.half()
    n = cache[0].numel()
    blocks_a = torch.arange(0, 2 * pairs, 2, device=device)
    blocks_b = blocks_a + 1
    low = torch.empty(pairs, 2 * n, dtype=torch.uint8, device=device)
    moved = pairs * n * 2 * 2 + pairs * n * 2 + pairs * 2 * n  # read A, B (fp16); write packed (fp16) + low bytes
    src = torch.empty(moved // 2, dtype=torch.uint8, device=device)  # a copy of X bytes moves 2X
    dst = torch.empty_like(src)
    rows = []
    med, p20, p80 = graph_time_us(lambda _: kv_demote(cache, blocks_a, blocks_b, low), 1)
    rows.append(Row("kv_demote", med, p20, p80, moved, moved / med / 1e6, f"{pairs} pairs of {2 * n} B blocks"))
    med, p20, p80 = graph_time_us(lambda _: dst.copy_(src), 1)
    rows.append(Row("d2d_copy", med, p20, p80, 2 * src.numel(), 2 * src.numel() / med / 1e6, "same bytes moved"))
    return rows


# Launch settings a sweep tries, each a tuple of module settings named by its SWEEPS entry; the first KV splits (0 =
# the op's choice) leads every row. "stages" (session 29): (TARGET pairs per tile, BASE pairs per tile, path 3's
# BASE-launch pairs per tile, warps, pipeline stages); compiled for sm90 (compile_report.py), 3 stages give the
# native kernel 96 registers and 14 async copies against 114 and 8 at 2 stages, and path 3's BASE launch 7 async
# copies against 4 at the same 104 registers. "base-launch" (session 32): path 3's BASE launch alone, (pairs per tile,
# its KV splits as a multiple of the first launch's, its register cap): after ncu put that launch at 3.9 resident
# programs of 16 warps a SM with issue slots 42 % busy (H100), more programs and fewer registers (96: 5 CTAs a SM, 80:
# 6) are what could add resident warps; only the cases it touches are timed.
SWEEPS = {
    "stages": (("TARGET_PAIRS_PER_TILE", "BASE_PAIRS_PER_TILE", "SPLIT_BASE_PAIRS_PER_TILE", "NUM_WARPS", "NUM_STAGES"),
               ((0, 2, 4, 2, 4, 2), (0, 2, 4, 2, 4, 3), (0, 2, 4, 2, 4, 4), (0, 2, 4, 4, 4, 3), (0, 2, 4, 2, 8, 3),
                (0, 4, 4, 2, 4, 3)), None),
    "base-launch": (("SPLIT_BASE_PAIRS_PER_TILE", "BASE_LAUNCH_SPLIT_FACTOR", "BASE_LAUNCH_MAX_REGISTERS"),
                    ((0, 2, 1, None), (0, 2, 1, 96), (0, 2, 2, None), (0, 2, 2, 96), (0, 2, 2, 80), (0, 2, 4, 96),
                     (0, 2, 4, 80), (0, 4, 2, 96)),
                    ("native", "all_base_split", "structured_15_split")),
    # session 33: BASE words unpacked by Triton's 16-bit ops against two at a time in inline PTX
    "unpack": (("UNPACK_BASE_PTX",), ((0, False), (0, True)),
               ("native", "all_base", "all_base_split", "structured_15", "general_15", "structured_15_split")),
    # session 33: path 3's BASE launch with a warp a slice (attention.BASE_LAUNCH_SLICES), with its KV splits x1 / x2
    # (168 registers: 3 CTAs of 4 slices a SM instead of 2, 12 bytes spilled, sm90 compile)
    # (the first row as shipped, the rest with the PTX unpack)
    "sliced": (("BASE_LAUNCH_SLICES", "BASE_LAUNCH_SPLIT_FACTOR", "BASE_LAUNCH_MAX_REGISTERS", "UNPACK_BASE_PTX"),
               ((0, 0, 1, None, False), (0, 0, 1, None, True), (0, 4, 1, None, True), (0, 4, 2, None, True),
                (0, 4, 1, 168, True),
                (0, 2, 1, None, True), (0, 2, 2, None, True)),
               ("native", "all_base_split", "structured_15_split")),
}


def sweep(shape: DecodeShape, device, name: str) -> list[dict]:
    """Try the launch settings of ``SWEEPS[name]`` on the decode cases (for tuning the module defaults), each against
    the same shapes; the module defaults are put back afterwards."""
    swept, settings, cases = SWEEPS[name]
    defaults = {setting: getattr(attention_mod, setting) for setting in swept}
    results = []
    try:
        for splits, *values in settings:
            for setting, value in zip(swept, values):
                setattr(attention_mod, setting, value)
            rows = bench_decode(shape, device, num_splits=splits, cases=cases)
            times = {r.case: round(r.us, 1) for r in rows}
            results.append({"splits": splits, **dict(zip(swept, values)), **times})
            print(results[-1], flush=True)
    finally:
        for setting, value in defaults.items():
            setattr(attention_mod, setting, value)
    return results


def print_table(rows: list[Row]) -> None:
    print(f"{'case':<18}{'us':>10}{'p20':>10}{'p80':>10}{'TB/s':>8}  note")
    for r in rows:
        print(f"{r.case:<18}{r.us:>10.1f}{r.p20_us:>10.1f}{r.p80_us:>10.1f}{r.tb_per_s:>8.2f}  {r.note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--num-splits", type=int, default=0, help="0 = the op's own choice")
    parser.add_argument("--table-tokens", type=int, default=0, help="block-table width in tokens (0: --context)")
    parser.add_argument("--sweep", choices=sorted(SWEEPS), help="also sweep these launch settings")
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = DecodeShape(batch=args.batch, context=args.context, table_tokens=args.table_tokens)
    rows = bench_decode(shape, device, args.num_splits) + bench_demote(shape, device)
    print_table(rows)
    by_case = {r.case: r.us for r in rows}
    ratios = {
        "native_vs_sdpa_speed": by_case["sdpa_contiguous"] / by_case["native"],
        "all_base_speedup_vs_native": by_case["native"] / by_case["all_base"],
        "structured_15_speedup_vs_native": by_case["native"] / by_case["structured_15"],
        "general_over_structured_time": by_case["general_15"] / by_case["structured_15"],
        "all_base_split_speedup_vs_native": by_case["native"] / by_case["all_base_split"],
        "structured_15_split_speedup_vs_native": by_case["native"] / by_case["structured_15_split"],
        "demote_vs_copy_bandwidth": by_case["d2d_copy"] / by_case["kv_demote"],
    }
    for key, value in ratios.items():
        print(f"{key:<36}{value:6.2f}")
    report = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), shape=asdict(shape), rows=[asdict(r) for r in rows], ratios=ratios,
    )  # fmt: skip
    if args.sweep:
        report["sweep"] = sweep(shape, device, args.sweep)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
