#!/usr/bin/env bash
# One device call on a one-GPU host (~5 min), session 21: decode attention whose last program of each (sequence,
# kv head) merges the KV splits in the attention launch (no reduction kernel). The attention GPU tests; the registers
# the JIT gave the attention kernels it compiled; then bench_attention at batches 1-4 in block tables for 8,192
# tokens (a graph captured for the longest context) with the change and with f584d56's attention (its two files,
# carried in .carry/old), side by side.
source ci/gpu/bootstrap.sh
set +e
start_round
kernels=packages/kernels/src/elastiserve/kernels
(time timeout 300 python3 -m pytest --device=cuda -p no:cacheprovider -q --durations=8 tests/kernels/test_attention.py \
  tests/kernels/test_attention_cuda.py) > $OUT/test-cuda.log 2>&1
grep -E "passed|failed|FAILED|Error|real" $OUT/test-cuda.log | tail -12
python3 - > $OUT/jit-kernels.txt 2>&1 <<'PY'
# Registers of the attention kernels as the JIT compiled them (real specialization: head_dim 128 divisible by 16).
import torch
from elastiserve.kernels.attention import paged_attention
from elastiserve.kernels.attention_kernels import paged_attention_kernel as fn

dev = torch.device("cuda")
for batch, context, table_tokens, path, q_len in ((1, 512, 8192, 0, 1), (1, 512, 8192, 3, 1), (64, 4096, 4096, 0, 1),
                                                  (64, 4096, 4096, 3, 1), (2, 256, 256, 0, 64)):
    blocks = table_tokens // 16
    cache = torch.randn(batch * blocks + 1, 2, 2, 8, 16, 128, device=dev).half()
    tables = torch.arange(batch * blocks, dtype=torch.int32, device=dev).view(batch, blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev) * q_len
    q = torch.randn(batch * q_len, 32, 128, device=dev).half()
    bounds = torch.tensor([[2, 6]] * batch, dtype=torch.int32, device=dev)
    paged_attention(q, cache, 1, tables, seq_lens, qsl, base_bounds=bounds, scale=0.088, max_query_len=q_len, path=path)
torch.cuda.synchronize()
names = fn.arg_names
for entry in fn.device_caches.values():
    for kernel in entry[0].values():
        kernel._init_handles()
        const = {(names[k[0]] if isinstance(k, tuple) else k): v for k, v in kernel.src.constants.items()}
        attrs = {(names[k[0]] if isinstance(k, tuple) else k): v for k, v in kernel.src.attrs.items()}
        shown = {k: const.get(k) for k in ("PATH", "PARTIALS", "MERGE", "NUM_SPLITS", "TOTAL_SPLITS", "MERGE_ROWS",
                                           "BASE_PAIRS", "BLOCK_M", "PDL")}
        print(shown, "head_dim divisible by 16:", "head_dim" in attrs, "regs", kernel.n_regs, "spills",
              kernel.n_spills, "smem", kernel.metadata.shared, flush=True)
PY
cat $OUT/jit-kernels.txt
mkdir -p /tmp/bench
bench() {  # NAME
  local name=$1 shape
  for shape in "1 512" "1 2048" "2 512" "4 1024"; do
    set -- $shape
    echo "== $name batch $1 context $2 (tables for 8192 tokens)"
    timeout 100 python3 benchmarks/kernels/bench_attention.py --batch $1 --context $2 --table-tokens 8192 \
      --out /tmp/bench/$name-b$1-c$2.json 2>&1 | head -9
  done
}
bench merge > $OUT/bench.log
cp $kernels/attention.py /tmp/attention.py; cp $kernels/attention_kernels.py /tmp/attention_kernels.py
cp .carry/old/attention.py .carry/old/attention_kernels.py $kernels/
bench reduce >> $OUT/bench.log
cp /tmp/attention.py /tmp/attention_kernels.py $kernels/
cat $OUT/bench.log
tar czf $OUT/bench-json.tgz -C /tmp bench
