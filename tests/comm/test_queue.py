from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from plait.comm import CollectiveQueue, all_reduce, stats
from plait.testing import run_distributed


def _two_stage_jobs(rank: int, world: int) -> list[float]:
    """Each job issues two dependent all-reduces with compute between them, like Power-SGD.

    Jobs are submitted from two threads at rank-dependent moments, yet the queue issues
    them in one order per rank; a mismatch would corrupt sums or raise in gloo.
    """
    q = CollectiveQueue(name="comm", timeout_s=60)
    rng = random.Random(rank)
    out: list[float] = []
    futs = []

    def job(i: int) -> float:
        a = torch.full((1000 + i,), float(rank + i))
        all_reduce(a, async_op=False)
        time.sleep(rng.random() * 0.01)
        b = a * 2
        all_reduce(b, async_op=False)
        return float(b[0])

    lock = threading.Lock()

    def submitter(ids: range) -> None:
        for i in ids:
            time.sleep(rng.random() * 0.005)
            with lock:  # submission order must itself be deterministic: one logical stream
                futs.append((i, q.submit(job, i)))

    t = threading.Thread(target=submitter, args=(range(0, 20),))
    t.start()
    t.join()
    q.drain()
    for _, f in sorted(futs):
        out.append(f.wait())
    q.close()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_queue_preserves_order(world: int) -> None:
    results = run_distributed(_two_stage_jobs, world_size=world)
    for i in range(20):
        expect = 2 * world * sum(r + i for r in range(world)) / world * 1.0
        expect = 2.0 * world * sum(float(r + i) for r in range(world))
        assert all(res[i] == expect for res in results), (i, [res[i] for res in results])


def test_drain_times_out_and_reraises() -> None:
    q = CollectiveQueue(timeout_s=0.3)
    gate = threading.Event()
    q.submit(gate.wait)
    with pytest.raises(TimeoutError, match="unfinished"):
        q.drain()
    gate.set()
    q.drain(timeout_s=5)

    def boom() -> None:
        raise RuntimeError("peer vanished")

    fut = q.submit(boom)
    with pytest.raises(RuntimeError, match="peer vanished"):
        q.drain(timeout_s=5)
    with pytest.raises(RuntimeError):
        fut.wait()
    q.close()


def test_counters_window() -> None:
    stats.reset()
    with stats.window() as recs:
        all_reduce(torch.ones(10))  # world 1: no traffic, nothing recorded
    assert recs == []


def test_failed_job_fails_later_jobs_and_real_future_errors() -> None:
    """After a failure the ranks' collective order has diverged: later jobs must not run,
    and the futures must carry real errors (DDP reads them in C++, not through Python)."""
    q = CollectiveQueue(timeout_s=5)
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("peer vanished")

    first = q.submit(boom)
    later = q.submit(ran.append, 1)
    with pytest.raises(RuntimeError, match="peer vanished"):
        q.drain()
    assert ran == []
    with pytest.raises(RuntimeError, match="earlier job failed"):
        later.wait()
    chained = first.then(lambda f: f.value())  # a torch-level error, not a returned object
    with pytest.raises(RuntimeError, match="peer vanished"):
        chained.wait()
    with pytest.raises(RuntimeError, match="peer vanished"):
        q.drain()  # a failed queue stays failed
    q.close()
