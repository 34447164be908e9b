"""Request streams for the simulator and the benchmark: real traces, length tables with synthetic arrivals, and
fixed synthetic lengths. Everything is deterministic for a given seed.

Trace files are looked up in an explicit directory, then in ``../shared/traces`` beside the working directory or
the repository checkout. The first 2,000 rows of the Azure conversation trace ship as package data
(``data/azure_conv_window.csv``, CC-BY-4.0, Patel et al., Splitwise, ISCA 2024) so the demo runs anywhere.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, replace
from datetime import datetime
from importlib import resources
from pathlib import Path

from elastiserve.platforms import ConfigError, ElastiserveError, env

TRACE_FILES = {
    "azure": "azure_llm_2023_conv.csv",
    "mooncake": "mooncake_fast25_conversation_trace.jsonl",
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "sharegpt-v3": "sharegpt_v3_prefix17k_lengths_smollm2.csv",
}
LENGTH_COLUMNS = {
    "sharegpt": ("num_prefill_tokens", "num_decode_tokens"),
    "arxiv": ("num_prefill_tokens", "num_decode_tokens"),
    "sharegpt-v3": ("first_prompt_tokens", "first_output_tokens"),
}
BUNDLED_AZURE = "azure_conv_window.csv"


class TraceNotFound(ElastiserveError, FileNotFoundError):
    """A trace file is in none of the searched places."""


@dataclass(frozen=True, slots=True)
class Request:
    req_id: int
    arrival: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.arrival < 0:
            raise ConfigError(f"invalid request {self}")


def trace_search_dirs(explicit: Path | None = None) -> list[Path]:
    repo_root = Path(__file__).resolve().parents[5]
    dirs = [explicit] if explicit else []
    if env.settings().trace_dir is not None:
        dirs.append(env.settings().trace_dir)
    return [*dirs, Path.cwd() / ".." / "shared" / "traces", repo_root / ".." / "shared" / "traces"]


def find_trace(name: str, trace_dir: Path | None = None) -> Path:
    """Path of a named trace (a key of TRACE_FILES) or of a file name, searching ``trace_search_dirs``."""
    file_name = TRACE_FILES.get(name, name)
    for directory in trace_search_dirs(trace_dir):
        candidate = directory / file_name
        if candidate.is_file():
            return candidate
    raise TraceNotFound(f"trace {file_name!r} not found in {[str(d) for d in trace_search_dirs(trace_dir)]}")


def bundled_azure_window() -> Path:
    return Path(str(resources.files("elastiserve.control") / "data" / BUNDLED_AZURE))


def _window(rows: list, start: int, count: int | None) -> list:
    if start < 0 or (count is not None and count < 0):
        raise ConfigError("window start and count must be >= 0")
    end = None if count is None else start + count
    return rows[start:end]


def _parse_azure_time(text: str) -> float:
    # 7 fractional digits: Python parses at most 6, so cut the tail (100 ns resolution is irrelevant here).
    head, _, frac = text.partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}").timestamp()


def _rebase(rows: list[tuple[float, int, int]], time_scale: float) -> list[Request]:
    """Arrival offsets from the first row of the window, multiplied by ``time_scale`` (16 = ElasticKV's d = 16
    dilation, 1/200 = DPS's 200x acceleration)."""
    if time_scale <= 0:
        raise ConfigError(f"time_scale must be > 0, got {time_scale}")
    if not rows:
        return []
    t0 = rows[0][0]
    return [
        Request(i, (t - t0) * time_scale, max(1, p), max(1, o)) for i, (t, p, o) in enumerate(rows)
    ]


def load_azure(path: Path, start: int = 0, count: int | None = None, time_scale: float = 1.0) -> list[Request]:
    """Azure LLM trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    with open(path, newline="") as f:
        rows = _window(list(csv.DictReader(f)), start, count)
    parsed = [(_parse_azure_time(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in rows]
    return _rebase(parsed, time_scale)


def load_mooncake(path: Path, start: int = 0, count: int | None = None, time_scale: float = 1.0) -> list[Request]:
    """Mooncake JSONL (timestamp in ms, input_length, output_length)."""
    with open(path) as f:
        rows = _window([line for line in f if line.strip()], start, count)
    parsed = []
    for line in rows:
        r = json.loads(line)
        parsed.append((r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"])))
    return _rebase(parsed, time_scale)


def load_lengths(path: Path, prompt_column: str, output_column: str, start: int = 0, count: int | None = None):
    """(prompt, output) token pairs from a length-statistics CSV."""
    with open(path, newline="") as f:
        rows = _window(list(csv.DictReader(f)), start, count)
    return [(int(float(r[prompt_column])), int(float(r[output_column]))) for r in rows]


def gamma_arrivals(n: int, rate: float, cv: float, seed: int) -> list[float]:
    """Arrival times with Gamma inter-arrivals of mean 1/rate and coefficient of variation cv (cv = 1: Poisson)."""
    if rate <= 0 or cv <= 0:
        raise ConfigError("rate and cv must be > 0")
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(shape, scale)
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    return gamma_arrivals(n, rate, 1.0, seed)


def with_arrivals(lengths: list[tuple[int, int]], arrivals: list[float]) -> list[Request]:
    return [Request(i, t, max(1, p), max(1, o)) for i, ((p, o), t) in enumerate(zip(lengths, arrivals, strict=True))]


def synthetic(n: int, prompt_tokens: int, output_tokens: int, rate: float, cv: float = 1.0, seed: int = 0):
    """Fixed lengths with Gamma(cv) arrivals at ``rate``."""
    return with_arrivals([(prompt_tokens, output_tokens)] * n, gamma_arrivals(n, rate, cv, seed))


def clip_lengths(requests: list[Request], max_prompt: int, max_output: int) -> list[Request]:
    return [replace(r, prompt_tokens=min(r.prompt_tokens, max_prompt), output_tokens=min(r.output_tokens, max_output))
            for r in requests]


def load_trace(
    name: str,
    start: int = 0,
    count: int | None = None,
    *,
    rate: float | None = None,
    cv: float = 2.0,
    seed: int = 0,
    time_scale: float = 1.0,
    trace_dir: Path | None = None,
) -> list[Request]:
    """One entry point. ``azure``/``mooncake`` keep their timestamps unless ``rate`` is given (then Gamma(cv)
    arrivals replace them); length tables always need ``rate``. ``azure-window`` is the bundled 2,000-row window."""
    if name == "azure-window":
        requests = load_azure(bundled_azure_window(), start, count, time_scale)
    elif name == "azure":
        try:
            path = find_trace(name, trace_dir)
        except TraceNotFound:
            path = bundled_azure_window()
        requests = load_azure(path, start, count, time_scale)
    elif name == "mooncake":
        requests = load_mooncake(find_trace(name, trace_dir), start, count, time_scale)
    elif name in LENGTH_COLUMNS:
        if rate is None:
            raise ConfigError(f"trace {name!r} has no timestamps: give a rate")
        lengths = load_lengths(find_trace(name, trace_dir), *LENGTH_COLUMNS[name], start=start, count=count)
        return with_arrivals(lengths, gamma_arrivals(len(lengths), rate, cv, seed))
    else:
        raise ConfigError(f"unknown trace {name!r}; choose from {sorted(TRACE_FILES)} or 'azure-window'")
    if rate is not None:
        arrivals = gamma_arrivals(len(requests), rate, cv, seed)
        return with_arrivals([(r.prompt_tokens, r.output_tokens) for r in requests], arrivals)
    return requests
