"""CUDA only: programmatic dependent launch (``kernels/launch.py``) changes when a kernel starts, never what it
computes. The same DPS engine decodes in full and fast mode with CUDA graphs twice, in subprocesses (the platform
is resolved once per process), with ELASTISERVE_PDL=on and off: the tokens and every logits tensor are bit-equal, and
graphs were replayed. On a GPU that cannot launch that way, "on" must refuse with a typed error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastiserve.platforms import current_platform
from elastiserve.platforms.capability import PDL_ARCHS

pytestmark = [pytest.mark.cuda]

PROBE = Path(__file__).resolve().parent / "pdl_probe.py"


def start_probe(pdl: str) -> subprocess.Popen:
    env = {**os.environ, "ELASTISERVE_PDL": pdl}
    return subprocess.Popen([sys.executable, str(PROBE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(probe: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = probe.communicate(timeout=600)
    return subprocess.CompletedProcess(probe.args, probe.returncode, stdout, stderr)


def test_pdl_on_and_off_compute_the_same_bits(device):
    # Both probes at once (the two in a row took 48.7 s of the serial GPU suite on an H100, session 40: each builds
    # an engine and compiles its kernels in its own process); each engine's KV pool is a fixed 16 MiB, so neither
    # sizes itself from memory the other holds.
    if current_platform().arch not in PDL_ARCHS:
        on = finish(start_probe("on"))
        assert on.returncode != 0 and "ELASTISERVE_PDL=on" in on.stderr
        return
    probes = start_probe("on"), start_probe("off")
    on, off = (finish(probe) for probe in probes)
    assert on.returncode == 0, on.stderr[-3000:]
    assert off.returncode == 0, off.stderr[-3000:]
    with_pdl, without = json.loads(on.stdout.splitlines()[-1]), json.loads(off.stdout.splitlines()[-1])
    assert with_pdl["pdl"] is True and without["pdl"] is False
    assert with_pdl["graphs"] > 0
    assert [len(t) for t in with_pdl["full"] + with_pdl["fast"]] == [10] * 6
    assert with_pdl["full"] == without["full"] and with_pdl["fast"] == without["fast"]
    assert with_pdl["logits_sha256"] == without["logits_sha256"]
