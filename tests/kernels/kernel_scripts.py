"""Loads a script of ``benchmarks/kernels`` as a module, registered under its name (dataclasses and pickling look
the module up there; the scripts import ``bench_nested_gemm`` from beside them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"


def load_kernel_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
