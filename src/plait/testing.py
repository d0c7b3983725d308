"""Run a function on several spawned processes joined in a gloo group (for tests).

``run_distributed(fn, world_size=4)`` spawns `world_size` fresh interpreters, gives them a
free rendezvous port, initialises a gloo process group with a timeout, calls
``fn(rank, world_size, *args)`` on each and returns the per-rank results. A worker that
raises fails the call with its traceback; a worker that dies or hangs fails it too, after
killing the others, so a broken collective cannot hang a test suite.

`fn` must be importable by name (a module-level function), as spawned processes
unpickle it.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from plait.cluster.launch import free_port


class WorkerError(RuntimeError):
    """A worker raised, died or timed out."""


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
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    base_env = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", **(env or {})}
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, base_env, timeout_s, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
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
