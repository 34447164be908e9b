"""Each package installs on its own, as the README promises (``pip install packages/<x>``): its wheel builds offline,
carries its data files, declares every third-party module its code imports at the top of a module, and the torch-free
pair (platforms + control) installs into a bare virtualenv from the wheels alone and runs a simulation there."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu]

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("platforms", "memory", "kernels", "control", "engine")
# import name -> distribution, for the third-party modules the packages import
DISTRIBUTIONS = {"torch": "torch", "triton": "triton", "numpy": "numpy", "aiohttp": "aiohttp", "gguf": "gguf",
                 "jinja2": "jinja2", "safetensors": "safetensors", "tokenizers": "tokenizers", "tqdm": "tqdm",
                 "matplotlib": "matplotlib", "cuda": "cuda-bindings", "hip": "hip-python"}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out, sources = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("sources")
    for p in PACKAGES:  # built from copies: setuptools writes build/ and egg-info into the tree it builds
        shutil.copytree(ROOT / "packages" / p, sources / p,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".ruff_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), *[str(sources / p) for p in PACKAGES]], check=True, capture_output=True)
    found = {p: next(out.glob(f"elastiserve_{p}-*.whl")) for p in PACKAGES}
    return found


def _requires(wheel: Path) -> tuple[set[str], set[str]]:
    """(required distributions, those of extras) from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(name).decode())
    required, extra = set(), set()
    for line in meta.get_all("Requires-Dist") or []:
        dist = line.split(";")[0].split("[")[0]
        for sep in "<>=!~ ":
            dist = dist.split(sep)[0]
        (extra if "extra ==" in line else required).add(dist.strip().lower())
    return required, extra


def _imports(package: str) -> tuple[set[str], set[str]]:
    """Third-party modules imported by the package's code: (at a module's top level, inside functions only)."""
    top, lazy = set(), set()
    for path in (ROOT / "packages" / package / "src").rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_nodes = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                root = name.split(".")[0]
                if root in sys.stdlib_module_names or root == "elastiserve":
                    continue
                (top if id(node) in top_nodes else lazy).add(root)
    return top, lazy


@pytest.mark.parametrize("package", PACKAGES)
def test_each_wheel_declares_what_its_code_imports_and_carries_its_data(wheels, package):
    required, extra = _requires(wheels[package])
    top, lazy = _imports(package)
    unknown = (top | lazy) - DISTRIBUTIONS.keys()
    assert not unknown, f"add {sorted(unknown)} to DISTRIBUTIONS (and to the package's dependencies)"
    if package != "platforms":  # platforms probes torch lazily when it is there: it must not require it
        missing = {DISTRIBUTIONS[m] for m in top} - required
        assert not missing, f"elastiserve-{package} imports {sorted(missing)} at module level without requiring it"
    undeclared = {DISTRIBUTIONS[m] for m in lazy} - required - extra - {"torch", "cuda-bindings", "hip-python"}
    assert not undeclared, f"elastiserve-{package} imports {sorted(undeclared)} in functions, not even as an extra"
    data = {p.relative_to(ROOT / "packages" / package / "src").as_posix()
            for p in (ROOT / "packages" / package / "src" / "elastiserve").rglob("*")
            if p.suffix in (".json", ".csv", ".jinja") and "__pycache__" not in p.parts}
    with zipfile.ZipFile(wheels[package]) as z:
        assert data <= set(z.namelist()), sorted(data - set(z.namelist()))


def test_platforms_and_control_install_alone_without_torch_and_simulate(wheels, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "-q",
                    str(wheels["platforms"]), str(wheels["control"])], check=True, capture_output=True)
    code = ("import sys\n"
            "from elastiserve.control import simulate\n"
            "print(simulate.__file__)\n"  # the bundled Azure window and the H200 step model, from the wheel
            "simulate.main(['--trace', 'azure', '--window', '0:40', '--presets', 'static-fp16,dps'])\n"
            "assert not any(m in sys.modules for m in ('torch', 'numpy')), 'control imported torch or numpy'\n")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(str(venv))  # the installed wheel, not the checkout
    assert "(40 requests)" in out.stdout and "dps" in out.stdout, out.stdout
