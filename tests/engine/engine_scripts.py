"""Loads a script of ``benchmarks/engine`` as a module (the scripts import their helpers from ``decode_setup``
beside them), or one of ``benchmarks/serving``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "engine"
SERVING_SCRIPTS = SCRIPTS.parent / "serving"


def load_engine_script(name: str):
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def load_serving_script(name: str):
    """Registered in ``sys.modules`` first: dataclasses look their module up while a class is created."""
    spec = importlib.util.spec_from_file_location(name, SERVING_SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
