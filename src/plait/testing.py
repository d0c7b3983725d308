"""Run a function on several spawned processes joined in a gloo group (for tests).

``run_distributed(fn, world_size=4)`` spawns `world_size` fresh interpreters, gives them a
free rendezvous port, initialises a gloo process group with a timeout, calls
``fn(rank, world_size, *args)`` on each and returns the per-rank results. A worker that
raises fails the call with its traceback; a worker that dies or hangs fails it too, after
killing the others, so a broken collective cannot hang a test suite.

`fn` must be importable by name (a module-level function), as spawned processes
unpickle it.

``run_faulty(fn, world_size=2, collective_timeout_s=10)`` is the fault-injection variant:
ranks may die (``os._exit``, a signal) or stop on purpose, and instead of failing on the
first of them it returns one `Outcome` per rank (returned, raised, died or hung) with the
time each surviving rank took, so a test can check that the survivors fail, how, and how
fast.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.context import SpawnProcess
from typing import Any, Literal

from plait.cluster.launch import free_port


class WorkerError(RuntimeError):
    """A worker raised, died or timed out."""


def _worker_env(rank: int, world_size: int, port: int, env: Mapping[str, str]) -> None:
    """The environment torchrun would give rank `rank` of a one-host job, plus `env`."""
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )


def _worker(  # noqa: PLR0917 - multiprocessing passes arguments positionally
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    timeout_s: float,
    results: Any,
) -> None:
    _worker_env(rank, world_size, port, env)
    import torch
    import torch.distributed as dist

    from plait import distributed as pdist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        value = fn(rank, world_size, *args)
        # plain pickle: torch's multiprocessing pickler would pass tensors as shared-memory
        # handles that vanish when this process exits
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):  # the result is already reported
            pdist.shutdown()


def _spawn(
    target: Callable[..., None],
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    env: Mapping[str, str] | None,
    timeout_s: float,
) -> tuple[list[SpawnProcess], Any]:
    """Start `world_size` spawned workers running `target` on one free port; return the
    processes and the queue they report to."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    base_env = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", **(env or {})}
    procs = [
        ctx.Process(
            target=target,
            args=(r, world_size, port, fn, args, base_env, timeout_s, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    # the workers start with `base_env`, before they import anything: unpickling `fn`
    # imports torch before `_worker` runs, and libraries that read OMP_NUM_THREADS when
    # they load missed a value set later. gloo's callback threads (where compression hooks
    # decompress) then rounded the same product differently on two ranks, and ACP-SGD's
    # replicas drifted apart by one rounding in 3 of 20 loaded runs (0 of 24 inherited).
    with _START_LOCK, _environ(base_env):
        for p in procs:
            p.start()
    return procs, results


#: One start at a time: the environment is the process's, so two threads starting jobs at
#: once (the crossover tests run three) would hand each other's variables to their
#: workers, or none, and restore the caller's environment out of order.
_START_LOCK = threading.Lock()


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with `env` added, restored afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Return ``[fn(rank, world_size, *args) for each rank]``, computed in parallel.

    Raises:
        WorkerError: a worker raised (its traceback is included), exited without a
            result, or did not finish within `timeout_s`.
    """
    procs, results = _spawn(_worker, world_size, fn, args, env=env, timeout_s=timeout_s)
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s + 60.0  # spawning takes a few seconds
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise WorkerError(
                        f"timed out after {timeout_s:.0f}s; finished ranks {sorted(out)}"
                    ) from None
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                silent = [r for r in dead if r not in out]
                if silent and results.empty():
                    time.sleep(1.0)  # let a late result arrive
                    if results.empty():
                        raise WorkerError(
                            f"rank(s) {silent} died (exit codes "
                            f"{[procs[r].exitcode for r in silent]}) without a result"
                        ) from None
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} raised:\n{value}")
                break
        if errors:
            raise WorkerError("\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]


@dataclass(frozen=True)
class Outcome:
    """How one rank of `run_faulty` ended.

    Attributes:
        rank: the rank.
        status: ``"returned"`` (fn returned `value`), ``"raised"`` (fn raised: `error` holds
            the traceback, `message` the exception's type and text), ``"died"`` (the process
            exited without a result: `exitcode`), or ``"hung"`` (still running when the
            others had finished and the grace period ran out; it was killed).
        value: fn's return value (``"returned"`` only).
        error: the formatted traceback (``"raised"`` only).
        message: ``"Type: text"`` of the exception (``"raised"`` only).
        exitcode: the process's exit code (negative: killed by that signal).
        elapsed_s: seconds from fn's start to its return or raise, measured by the rank.
        exception: the raised exception's class, ``module.QualName`` (``"raised"`` only).
    """

    rank: int
    status: Literal["returned", "raised", "died", "hung"]
    value: Any = None
    error: str = ""
    message: str = ""
    exitcode: int | None = None
    elapsed_s: float | None = None
    exception: str = ""


def _faulty_worker(  # noqa: PLR0917 - multiprocessing passes arguments positionally
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    timeout_s: float,
    results: Any,
) -> None:
    _worker_env(rank, world_size, port, env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    start = time.monotonic()
    try:
        value = fn(rank, world_size, *args)
    except BaseException as exc:
        elapsed = time.monotonic() - start
        message = f"{type(exc).__name__}: {exc}"
        cls = f"{type(exc).__module__}.{type(exc).__qualname__}"
        results.put((rank, False, (traceback.format_exc(), message, cls), elapsed))
    else:
        elapsed = time.monotonic() - start
        results.put((rank, True, pickle.dumps(value), elapsed))
    # no orderly shutdown: after a fault, destroying a gloo group can block on dead peers
    results.close()
    results.join_thread()
    os._exit(0)


def _stopped(pid: int | None) -> bool:
    """Whether process `pid` is stopped (SIGSTOP): it will never report by itself."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in {"T", "t"}
    except (OSError, IndexError):
        return False


def run_faulty(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    collective_timeout_s: float = 10.0,
    grace_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` on spawned ranks that may fail on purpose.

    The gloo group is initialised with `collective_timeout_s`, so a rank blocked on a dead
    or stopped peer must give up within about that time. Once every rank has returned,
    raised or died, or `grace_s` (default: three collective timeouts plus 30 s for
    spawning) has passed, every process still running is killed with SIGKILL (which also
    ends a SIGSTOPped one) and reported as ``"hung"``. A stopped rank counts as finished
    for that wait: it cannot report until someone resumes it.

    Returns:
        One `Outcome` per rank, in rank order.
    """
    procs, results = _spawn(
        _faulty_worker, world_size, fn, args, env=env, timeout_s=collective_timeout_s
    )
    limit = 3 * collective_timeout_s + 30.0 if grace_s is None else grace_s
    deadline = time.monotonic() + limit
    reported: dict[int, Outcome] = {}

    def drain(wait_s: float) -> None:
        with contextlib.suppress(queue.Empty):
            rank, ok, payload, elapsed = results.get(timeout=wait_s)
            if ok:
                reported[rank] = Outcome(
                    rank, "returned", value=pickle.loads(payload), elapsed_s=elapsed
                )
            else:
                reported[rank] = Outcome(
                    rank,
                    "raised",
                    error=payload[0],
                    message=payload[1],
                    elapsed_s=elapsed,
                    exception=payload[2],
                )

    try:
        while time.monotonic() < deadline:
            drain(0.2)
            gone = {r for r, p in enumerate(procs) if p.exitcode is not None or _stopped(p.pid)}
            if len(reported.keys() | gone) == world_size:
                break
        drain(0.5)  # a result sent just before its process exited
        while True:
            before = len(reported)
            drain(0.05)
            if len(reported) == before:
                break
    finally:
        hung = set()
        for r, p in enumerate(procs):
            if p.is_alive() and r not in reported:
                hung.add(r)
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
        for p in procs:
            p.join(timeout=10)
    out: list[Outcome] = []
    for r, p in enumerate(procs):
        if r in reported:
            o = reported[r]
            out.append(
                Outcome(
                    o.rank,
                    o.status,
                    o.value,
                    o.error,
                    o.message,
                    p.exitcode,
                    o.elapsed_s,
                    o.exception,
                )
            )
        else:
            out.append(Outcome(r, "hung" if r in hung else "died", exitcode=p.exitcode))
    return out
