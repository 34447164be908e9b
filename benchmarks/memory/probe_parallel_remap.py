"""Question: do cuMemUnmap / cuMemMap / cuMemSetAccess from several host threads run in parallel, or does the driver
serialize them? Remaps 512 units of 2 MiB with 1, 2, 4 and 8 threads and prints units per second.

    python benchmarks/memory/probe_parallel_remap.py
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from elastiserve.memory.vmm import open_backend

UNITS = 512


def remap_slice(backend, va: int, unit: int, handles: list, indices: range) -> None:
    for i in indices:
        backend.unmap(va + i * unit, unit)
        backend.map(va + i * unit, unit, handles[(i + 1) % len(handles)])
        backend.set_access(va + i * unit, unit)


def main() -> None:
    backend = open_backend("cuda")
    unit = backend.granularity()
    handles = [backend.create(unit) for _ in range(UNITS)]
    va = backend.reserve(UNITS * unit)
    for i in range(UNITS):
        backend.map(va + i * unit, unit, handles[i])
    backend.set_access(va, UNITS * unit)
    results = {}
    for threads in (1, 2, 4, 8):
        per = UNITS // threads
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            slices = [range(t * per, (t + 1) * per) for t in range(threads)]
            for future in [pool.submit(remap_slice, backend, va, unit, handles, s) for s in slices]:
                future.result()
            elapsed = time.perf_counter() - start
        results[threads] = {"us_per_unit": 1e6 * elapsed / UNITS, "gbps": UNITS * unit / elapsed / 1e9}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
