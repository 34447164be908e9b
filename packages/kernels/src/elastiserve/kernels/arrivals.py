"""In-launch merges: the programs that share an output (the KV splits of one decode attention row, the split-K
slices of one GEMM tile) each store a partial, and the one that finishes last merges them, so no second kernel runs
(the split-K semaphore pattern). ``last_to_arrive`` is the device side, ``arrival_counters`` the host side.

The protocol: every program stores its partial, then :func:`last_to_arrive` counts it in on the counter of its
output: a CTA barrier, then one ``atomic_add(counter, 1, sem="acq_rel", scope="gpu")``. The program that reads
``ARRIVALS - 1`` merges and stores 0 back, so the counters are zero before every launch and after it.

Why the last program sees every partial (the PTX memory model; HSA's scoped model on ROCm says the same):

- In each program the barrier (``bar.sync``) orders every thread's partial stores before the atomic, which one
  thread issues: the stores happen before that thread's release.
- A release at gpu scope is cumulative: it publishes the stores that happen before it, not only its own thread's.
  Atomic adds on one counter form a release sequence, so the last program's acquire (the same atomic) reads a value
  that every earlier program's release wrote into, and every store published by those releases happens before it.
- Triton hands a scalar atomic's result to all threads through shared memory behind a barrier, so every thread's
  merge loads come after the acquire (the sm90 PTX: ``atom.global.gpu.acq_rel.add``, then ``bar.sync``).

No program waits for another, so nothing depends on which programs are resident (no deadlock at any grid size),
and the CPU interpreter, which runs the programs one after another, finds the last one last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_COUNTERS = 8192  # int32 entries (32 KiB) a buffer starts with: batch 1,024 x 8 kv heads before the first growth

# One buffer per (owner, device), allocated eagerly and zeroed once; a captured CUDA graph keeps its address and
# relies on it staying zero, so an outgrown buffer is kept alive, never freed. The engine warms every batch size up
# before capturing, so a buffer does not grow inside a capture; if it has to, the call takes a temporary zeroed inside
# the capture instead (the graph replays that memset before the kernel: correct, one memset node more; not cached,
# since outside replays its contents are undefined). Launches that share a buffer must not overlap: the kernels of
# one owner on one device run in stream order (PDL included: a grid's griddepcontrol.wait waits for the whole
# previous grid), never on two streams at once; each owner (attention, GEMM) has its own buffer all the same.
_counters: dict[tuple[str, torch.device], torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []


def arrival_counters(owner: str, device: torch.device, entries: int) -> torch.Tensor:
    """int32 zeros of at least ``entries`` on ``device``, ``owner``'s buffer (``last_to_arrive``'s counters)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (owner, device)
    counters = _counters.get(key)
    if counters is not None and counters.numel() >= entries:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(entries, dtype=torch.int32, device=device)
    if counters is not None:
        _outgrown.append(counters)
    counters = torch.zeros(max(MIN_COUNTERS, triton.next_power_of_2(entries)), dtype=torch.int32, device=device)
    _counters[key] = counters
    return counters


@triton.jit
def last_to_arrive(counter_ptr, ARRIVALS: tl.constexpr):
    """Count this program in at ``counter_ptr``; true in the last of the ARRIVALS programs that share the counter.
    Call it after the stores the last program reads (the module docstring says why they are then visible). Triton's
    sm90 lowering of a scalar atomic puts a barrier before it as well (the two compile to one ``bar.sync``); the
    explicit one keeps the ordering from resting on that."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == ARRIVALS - 1
