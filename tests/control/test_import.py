"""Pins that the control plane is plain Python: importing every control module never imports torch."""

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

MODULES = [
    "elastiserve.control",
    "elastiserve.control.arbiter",
    "elastiserve.control.config",
    "elastiserve.control.events",
    "elastiserve.control.kv_fidelity",
    "elastiserve.control.metrics",
    "elastiserve.control.observation",
    "elastiserve.control.pool",
    "elastiserve.control.precision",
    "elastiserve.control.simulate",
    "elastiserve.control.simulator",
    "elastiserve.control.step_budget",
    "elastiserve.control.step_model",
    "elastiserve.control.workloads",
]


def test_control_never_imports_torch():
    code = "import importlib, sys\n"
    code += "".join(f"importlib.import_module({m!r})\n" for m in MODULES)
    code += "heavy = sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules)\nprint(heavy)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
