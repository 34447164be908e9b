"""Every ELASTISERVE_* environment variable, parsed here and nowhere else."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from elastiserve.platforms.errors import ConfigError

PREFIX = "ELASTISERVE_"

_CHOICES = {
    "PLATFORM": ("auto", "cuda", "rocm", "cpu"),
    "VMM": ("auto", "cuda", "hip", "host"),
    "KERNELS": ("auto", "triton", "reference"),
    "LOG_LEVEL": ("debug", "info", "warning", "error"),
    "PDL": ("auto", "on", "off"),
}


@dataclass(frozen=True, slots=True)
class EnvSettings:
    platform: str = "auto"  # force a platform; a request the machine cannot meet raises
    vmm: str = "auto"  # force a VMM back-end
    kernels: str = "auto"  # triton (interpreted on CPU when TRITON_INTERPRET=1) or reference
    cache_dir: Path = Path.home() / ".cache" / "elastiserve"
    log_level: str = "info"
    # Programmatic dependent launch of the Triton kernels (sm90+): "on" where the GPU cannot raises; "auto" takes
    # the platform's measured default (capability.PDL_BY_DEFAULT).
    pdl: str = "auto"
    trace_dir: Path | None = None  # searched for request traces before ../shared/traces (GPU runs carry a copy)
    # The commit benchmark results record. GPU copies of the tree can carry stale git metadata (two H200 runs
    # recorded an older HEAD than the tree they ran), so ci/gpu/bootstrap.sh passes the one written before the call.
    source_commit: str | None = None
    # Every this many seconds, each tensor-parallel rank dumps all its threads' stacks to stderr (faulthandler): how
    # a stalled multi-GPU run shows where each rank waits. Unset: never.
    debug_stacks_s: float | None = None

    def __post_init__(self) -> None:
        if self.debug_stacks_s is not None and not self.debug_stacks_s > 0:
            raise ConfigError(f"{PREFIX}DEBUG_STACKS_S must be a positive number of seconds, got {self.debug_stacks_s}")
        for field, choices in _CHOICES.items():
            value = getattr(self, field.lower())
            if value not in choices:
                raise ConfigError(f"{PREFIX}{field}={value!r}: expected one of {', '.join(choices)}")


def parse(environ: dict[str, str] | os._Environ) -> EnvSettings:
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k[len(PREFIX):] not in _KNOWN)
    if unknown:
        raise ConfigError(f"unknown environment variables {unknown}; known: {sorted(PREFIX + k for k in _KNOWN)}")
    kwargs: dict[str, object] = {}
    for key in _KNOWN:
        if PREFIX + key in environ:
            value = environ[PREFIX + key].strip()
            is_path = key in ("CACHE_DIR", "TRACE_DIR")
            if is_path:
                kwargs[key.lower()] = Path(value).expanduser()
            elif key == "DEBUG_STACKS_S":
                try:
                    kwargs["debug_stacks_s"] = float(value)
                except ValueError:
                    raise ConfigError(f"{PREFIX}DEBUG_STACKS_S={value!r}: expected seconds") from None
            else:
                kwargs[key.lower()] = value if key == "SOURCE_COMMIT" else value.lower()
    return EnvSettings(**kwargs)


_KNOWN = ("PLATFORM", "VMM", "KERNELS", "CACHE_DIR", "LOG_LEVEL", "TRACE_DIR", "SOURCE_COMMIT", "DEBUG_STACKS_S",
          "PDL")


@functools.cache
def settings() -> EnvSettings:
    return parse(os.environ)


def triton_interpret() -> bool:
    """Triton's own switch; read here so the rest of the code base never touches os.environ."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
