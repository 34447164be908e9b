"""Benchmark harness: replay workloads in-process or over HTTP, summarise with `elastiserve.control.metrics`,
write JSON results and PNG plots. ``elastiserve bench`` is the command-line front end (`bench.cli_args`)."""

from elastiserve.engine.bench.replay import ReplayResult, replay_in_process
from elastiserve.engine.bench.results import run_metadata, summarize
from elastiserve.engine.bench.workload import WorkloadSpec, build_requests, make_prompts

__all__ = ["ReplayResult", "WorkloadSpec", "build_requests", "make_prompts", "replay_in_process", "run_metadata",
           "summarize"]
