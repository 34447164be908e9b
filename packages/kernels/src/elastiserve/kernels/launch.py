"""Programmatic dependent launch (PDL): a kernel of a decode step starts while the one before it drains.

A batch-1 decode step of an 8B model runs ~330 kernels, most of them a few microseconds long, so the gap between
two dependent kernels (the next grid's launch and ramp-up after the last block of the previous one retires) is a
real share of the step. On sm90 a kernel launched with the PDL attribute may start once every block of the kernel
before it has executed ``griddepcontrol.launch_dependents``; it then waits in ``griddepcontrol.wait`` until that
kernel has finished and its memory is visible. Every kernel here that can be launched that way calls
``wait_for_prior_grid`` before its first global memory access, so it reads and writes exactly what it would after
an ordinary launch; only the launch overlaps. A kernel launched without the attribute (torch's, cuBLAS's) waits for
the whole previous kernel as always, and CUDA graph capture keeps the programmatic edges.

Whether PDL is on is the platform's ``programmatic_launch`` (``ELASTISERVE_PDL``), resolved once: on by default on
sm90, where it cut the batch-1 decode step by 5-8 % in both modes (capability.PDL_BY_DEFAULT).
"""

from __future__ import annotations

import triton
import triton.language as tl

from elastiserve.platforms import current_platform


@triton.jit
def wait_for_prior_grid(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel has finished, then let the next one launch (a no-op without)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_options() -> dict:
    """Launch keywords of a kernel that takes ``PDL: tl.constexpr`` and calls ``wait_for_prior_grid(PDL)`` first:
    empty (an ordinary launch) unless the platform launches programmatically."""
    return {"PDL": True, "launch_pdl": True} if current_platform().programmatic_launch else {}

