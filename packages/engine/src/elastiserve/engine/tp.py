"""Tensor parallelism: one process per device over ``torch.distributed`` (``--tensor-parallel-size N``): NCCL with one
GPU per rank, gloo on the CPU (each rank then a host VMM pool of its own, which is how CI runs it end to end).

Sharding (Megatron style, ``tp_sharding.py``): attention heads and MLP / expert intermediate slices per rank, an
all-reduce after each row-parallel projection. Each rank owns its KV pool and SUM shared region for its own heads and
weight shards.

Rank 0 runs the scheduler, the KV manager and control. Everything that touches a device goes through
``TPRunner``, which broadcasts each call (a ``Plan``) before doing it locally, and every other rank replays the same
calls in the same order in ``worker_loop``: step inputs, pair demotions / promotions, mode changes. Unit-level
decisions (Algorithm 1) are replayed too: rank 0's block pool records every allocate / free / evict, and each plan
carries that log so the workers' ``SumState`` books, and hence their residual mappings and fast layers, match rank 0's.
Restores commit on rank 0 only after every rank reports its copies done (an all-reduce of a flag).

This module is isolated on purpose: nothing imports it unless ``tensor_parallel_size > 1``.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastiserve.engine.errors import DemotionFailed, EngineError
from elastiserve.engine.step_inputs import forward_inputs
from elastiserve.engine.tp_sharding import shard_model
from elastiserve.platforms import ConfigError
from elastiserve.platforms.env import settings

log = logging.getLogger(__name__)

REAP_TIMEOUT_S = 30.0  # how long rank 0 waits for the workers to exit after the shutdown plan before terminating them
# Workers wait for the next plan as long as the engine idles, so plans get a group of their own without a practical
# timeout: on the default group an engine idle for tp_timeout_s (torch's default: 10 min NCCL, 30 min gloo) killed
# its workers. A rank that dies still fails the wait at once (the connection closes).
PLAN_TIMEOUT = timedelta(days=365)


class TPError(EngineError):
    """The ranks fell out of step: a worker died before joining, its books diverged from rank 0's, or a probe failed."""


# ---- process group ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int
    world_size: int
    device: torch.device
    plans: Any = None  # the gloo group plans travel on (CPU objects: no device sync per plan on a GPU either)
    workers: tuple = ()  # rank 0 only: the spawned processes of ranks 1..N-1
    rendezvous_dir: str | None = None  # rank 0 only: the temporary directory of the file:// rendezvous


def init_tp(rank: int, world_size: int, init_method: str, device_type: str, timeout_s: float | None) -> TPGroup:
    """Join the group: NCCL with GPU ``rank`` on CUDA, gloo on the CPU. ``init_method`` is the launcher's URL;
    ``timeout_s`` bounds the rendezvous and every collective (None: torch's default)."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        # Every rank is on this host, so NCCL's bootstrap sockets belong on loopback. Left to itself NCCL picks the
        # first non-loopback interface, which on an isolated host may route nowhere; unverified as the cause, but
        # the two-H200 TP runs stalled without output (BENCHMARKS.md). A user's own setting wins.
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        backend, device = "nccl", torch.device("cuda", rank)
    elif device_type == "cpu":
        backend, device = "gloo", torch.device("cpu")
    else:
        raise ConfigError(f"tensor parallelism runs on cuda or cpu, not {device_type!r}")
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    debug_stacks_s = settings().debug_stacks_s
    if debug_stacks_s is not None:  # a stalled run then shows where every rank waits, not only the test's rank 0
        faulthandler.dump_traceback_later(debug_stacks_s, repeat=True)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **timeout)
    return TPGroup(rank, world_size, device, dist.new_group(backend="gloo", timeout=PLAN_TIMEOUT))


# ---- the step plan ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Plan:
    """One runner call to replay on every rank, with the pool operations rank 0 did since the previous plan."""

    method: str
    args: tuple = ()
    pool_log: list[tuple] = field(default_factory=list)


class RecordingPool:
    """Wraps rank 0's block pool: every state change is logged so workers can replay it on their own books."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_blocks = inner.num_blocks
        self.state = inner.state
        self.log: list[tuple] = []

    def num_free(self, allow_backed: bool = False) -> int:
        return self.inner.num_free(allow_backed)

    def num_allocated(self) -> int:
        return self.inner.num_allocated()

    def allocate(self, n: int, allow_backed: bool = False) -> list[int] | None:
        blocks = self.inner.allocate(n, allow_backed)
        if blocks:
            self.log.append(("allocate", n, allow_backed, tuple(blocks)))
        return blocks

    def free(self, blocks) -> None:
        blocks = list(blocks)
        self.inner.free(blocks)
        self.log.append(("free", tuple(blocks)))

    def drain_stale_layers(self) -> frozenset[int]:
        return self.inner.drain_stale_layers()

    def take_log(self) -> list[tuple]:
        log_, self.log = self.log, []
        return log_


def replay_pool_log(pool: Any, entries: list[tuple]) -> None:
    """Apply rank 0's pool operations to a worker's pool; Algorithm 1 is deterministic, so the blocks must match."""
    for entry in entries:
        if entry[0] == "allocate":
            _, n, allow_backed, expected = entry
            got = pool.allocate(n, allow_backed)
            if tuple(got or ()) != expected:
                raise TPError(f"tensor-parallel books diverged: allocate({n}) gave {got}, rank 0 {expected}")
        elif entry[0] == "free":
            pool.free(list(entry[1]))
        elif entry[0] == "evict":
            pool.state.evict_layers(list(entry[1]))  # the same books the SUM manager's evict_layers updates


class TPRunner:
    """Rank 0's stand-in for ``ModelRunner``: broadcast each device call, then make it locally."""

    BROADCAST = ("run", "demote", "start_promote", "set_fast_layers", "release_request", "warm_up")
    OWN = ("runner", "group", "pool", "recording")

    def __init__(self, runner: Any, group: TPGroup) -> None:
        self.runner = runner
        self.group = group
        self.pool = runner.pool
        self.recording = RecordingPool(runner.pool.block_pool)
        runner.pool.block_pool = self.recording

    def __setattr__(self, name: str, value: Any) -> None:
        # The engine writes runner attributes too (``graphs = None`` on close, ``forced_fast_layers``): they must
        # reach the real runner, or close() would leave rank 0's CUDA graphs and their memory pool alive.
        if name in self.OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.runner, name, value)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.runner, name)
        if name not in self.BROADCAST:
            return attr

        def call(*args: Any) -> Any:
            _broadcast(self.group, Plan(name, args, self.recording.take_log()))
            try:
                return attr(*args)
            except DemotionFailed as exc:  # the other ranks packed every pair already: rank 0 cannot take any back
                raise TPError(f"demotion failed on rank 0 after every other rank started it: {exc}") from exc

        return call

    def execute(self, batch: Any, kv: Any) -> Any:
        inputs = self.runner.step_inputs(batch, kv)
        _broadcast(self.group, Plan("run", (forward_inputs(inputs),), self.recording.take_log()))
        return self.runner.run(inputs)

    def evict_layers(self, layers: list[int]) -> None:
        self.runner.evict_layers(layers)
        self.recording.log.append(("evict", tuple(layers)))

    def between_steps(self, restore_layers: tuple[int, ...] | None) -> Any:
        """Restores commit only when every rank's copies are done, so all ranks leave fast mode together."""
        _broadcast(self.group, Plan("between_steps", (restore_layers,), self.recording.take_log()))
        return _between_steps_all_ranks(self.runner, restore_layers)

    def on_every_rank(self, fn: Any, *args: Any) -> list[Any]:
        """``fn(runner, *args)`` on every rank (after the pool log so far); the results in rank order. For tests and
        debugging, which cannot reach the workers' state otherwise; ``fn`` must be importable by name."""
        _broadcast(self.group, Plan("call", (fn, args), self.recording.take_log()))
        return _call_and_gather(self.runner, fn, args, self.group.world_size)


def _between_steps_all_ranks(runner: Any, restore_layers: tuple[int, ...] | None) -> Any:
    flag = torch.tensor([int(runner.pool.manager.restores_landed())], device=runner.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() == 1:
        return runner.between_steps(restore_layers)  # every rank done: commit and start the same tasks
    return _deferred_report()  # someone is still copying: nobody commits, so the ranks' books stay equal


def _deferred_report() -> Any:
    from elastiserve.memory.sum_manager import StepReport

    return StepReport((), (), 0, deferred=True)


def _call_and_gather(runner: Any, fn: Any, args: tuple, world_size: int) -> list[Any] | None:
    try:
        result = fn(runner, *args)
    except Exception as exc:  # still gathered, so a failing probe cannot leave the other ranks waiting
        result = exc
    results = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(result, results, dst=0)
    if results is not None:
        for rank, item in enumerate(results):
            if isinstance(item, Exception):
                raise TPError(f"{fn.__name__} failed on tensor-parallel rank {rank}") from item
    return results


def _broadcast(group: TPGroup, plan: Plan) -> None:
    dist.broadcast_object_list([plan], src=0, group=group.plans)


def worker_loop(runner: Any, group: TPGroup) -> None:
    """Ranks 1..N-1: replay rank 0's plans until it shuts down."""
    pool = runner.pool.block_pool
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group.plans)
        plan: Plan = box[0]
        replay_pool_log(pool, plan.pool_log)
        if plan.method == "shutdown":
            return
        if plan.method == "between_steps":
            _between_steps_all_ranks(runner, *plan.args)
        elif plan.method == "call":
            _call_and_gather(runner, *plan.args, group.world_size)
        elif plan.method == "run":
            runner.run(*plan.args, sample=False)
        else:
            getattr(runner, plan.method)(*plan.args)
        runner.poll_promotions()  # rank 0 decides publication; workers only drop their finished events


# ---- launching -------------------------------------------------------------------------------------------------
def start(config: Any, device: torch.device) -> TPGroup:
    """Spawn ranks 1..N-1 (each loads, shards and serves its part) and join the group as rank 0."""
    import torch.multiprocessing as mp

    world = config.tensor_parallel_size
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ConfigError(f"tensor_parallel_size={world} but only {torch.cuda.device_count()} GPUs are visible")
    rendezvous = tempfile.mkdtemp(prefix="elastiserve-tp-")  # a fresh file store: no port to race for
    init_method = f"file://{rendezvous}/store"
    ctx = mp.get_context("spawn")
    workers, joining = [], []
    try:
        for rank in range(1, world):
            receive, send = ctx.Pipe(duplex=False)
            args = (rank, world, init_method, config, device.type, send)
            process = ctx.Process(target=worker_main, args=args, name=f"elastiserve-tp{rank}", daemon=True)
            process.start()
            send.close()  # the worker holds the only write end now: its exit reads as EOF
            workers.append(process)
            joining.append(receive)
        for process, receive in zip(workers, joining):
            _wait_until_joining(process, receive)
        group = init_tp(0, world, init_method, device.type, config.tp_timeout_s)
    except BaseException:
        _reap(workers, timeout_s=0.0)
        shutil.rmtree(rendezvous, ignore_errors=True)
        raise
    finally:
        for receive in joining:
            receive.close()
    return dataclasses.replace(group, workers=tuple(workers), rendezvous_dir=rendezvous)


def _wait_until_joining(process: Any, receive: Any) -> None:
    """A worker that dies before the rendezvous (an import error, a script without a ``__main__`` guard re-run by
    spawn) would leave rank 0 waiting there until the timeout: fail now with its exit code instead."""
    try:
        receive.recv()
    except EOFError:
        process.join()
        raise TPError(
            f"tensor-parallel worker {process.name} exited with code {process.exitcode} before joining "
            "the group (its traceback is on stderr)"
        ) from None


def stop(group: TPGroup) -> None:
    """Rank 0: send the shutdown plan, leave the group, and reap the workers (terminating any that hang)."""
    try:
        _broadcast(group, Plan("shutdown"))
    except Exception as exc:  # a worker died or the group timed out; the reaping below ends whatever is left
        log.warning("tensor-parallel shutdown could not reach every worker: %s", exc)
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
        _reap(group.workers, REAP_TIMEOUT_S)
        if group.rendezvous_dir is not None:
            shutil.rmtree(group.rendezvous_dir, ignore_errors=True)


def _reap(workers: list | tuple, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in workers:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in workers:
        if process.is_alive():
            log.warning("tensor-parallel worker %s (pid %d) did not exit: terminating it", process.name, process.pid)
            process.terminate()
            process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()


def worker_main(rank: int, world: int, init_method: str, config: Any, device_type: str, joining: Any) -> None:
    """Entry point of ranks 1..N-1: the same model load, shard and runner as rank 0, then replay its plans."""
    from elastiserve.engine.loader import load_model
    from elastiserve.engine.runner import ModelRunner

    # A spawned process starts with logging unconfigured: give it the engine's level, its lines tagged by rank.
    logging.basicConfig(level=settings().log_level.upper(),
                        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    joining.send(rank)
    joining.close()
    group = init_tp(rank, world, init_method, device_type, config.tp_timeout_s)
    runner = None
    try:
        start = time.perf_counter()
        model, _, _ = load_model(config)
        model = model.to(group.device)
        shard_model(model, group)
        runner = ModelRunner(config, model, group.device)
        log.info("model loaded and sharded, runner ready in %.1f s; replaying rank 0's plans",
                 time.perf_counter() - start)
        worker_loop(runner, group)
        if runner.pool.manager is not None:
            runner.pool.manager.close()
    finally:
        if runner is not None:
            runner.graphs = None  # before the communicator goes: NCCL waits for graphs that captured its collectives
            if device_type == "cuda":
                torch.cuda.synchronize(group.device)
        dist.destroy_process_group()
