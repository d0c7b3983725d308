"""`plait.comm.stats`: per-worker wire bytes and latency steps of the ring algorithms, and
the thread-safe record keeper."""

from __future__ import annotations

import threading

import pytest

from plait.comm.stats import Collective, CommStats, latency_steps, wire_bytes


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        # ring all-reduce: a reduce-scatter then an all-gather, each (p-1)/p of the buffer
        (Collective.ALL_REDUCE, 2 * 3 / 4 * 1000),
        (Collective.ALL_GATHER, 3 * 1000),  # nbytes is this worker's shard
        (Collective.REDUCE_SCATTER, 3 / 4 * 1000),
        (Collective.ALL_TO_ALL, 3 / 4 * 1000),
        (Collective.BROADCAST, 1000),
        (Collective.SEND, 1000),
        (Collective.BARRIER, 0),
    ],
)
def test_wire_bytes_of_ring_algorithms(op: Collective, expected: float) -> None:
    assert wire_bytes(op, 1000, 4) == pytest.approx(expected)
    assert wire_bytes(op, 1000, 1) == 0.0  # alone: nothing travels


def test_latency_steps() -> None:
    assert latency_steps(Collective.ALL_REDUCE, 4) == 6
    assert latency_steps(Collective.ALL_GATHER, 4) == 3
    assert latency_steps(Collective.BROADCAST, 5) == 3  # a tree: ceil(log2 p)
    assert latency_steps(Collective.SEND, 8) == 1
    assert latency_steps(Collective.ALL_REDUCE, 1) == 0


def test_records_from_threads_and_windows() -> None:
    stats = CommStats()

    def add_many() -> None:
        for _ in range(50):
            stats.add(Collective.ALL_REDUCE, 100, 2)

    threads = [threading.Thread(target=add_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.calls == 200 and stats.payload_bytes == 20_000
    assert stats.wire_bytes == pytest.approx(200 * 100.0)  # 2(p-1)/p = 1 at p = 2
    with stats.window() as inside:
        stats.add(Collective.ALL_GATHER, 8, 2)
    assert [(r.op, r.nbytes) for r in inside] == [(Collective.ALL_GATHER, 8)]
    assert len(stats.reset()) == 201 and stats.calls == 0


def test_owned_records_follow_queue_jobs_past_their_window() -> None:
    """A job handed to a CollectiveQueue inside `owned_by` is counted for its owner even
    when it runs after the submitter's window closed (a race switching entries)."""
    from plait.comm.queue import CollectiveQueue

    s = CommStats()
    release = threading.Event()
    mine, other = object(), object()

    def job() -> None:
        release.wait(10)
        s.add(Collective.ALL_REDUCE, 100, 4)

    q = CollectiveQueue(name="test-owner", timeout_s=10)
    try:
        with s.owned_by(mine), s.window() as first:
            fut = q.submit(job)
            s.add(Collective.BROADCAST, 10, 4)
        with s.owned_by(other), s.window() as second:
            release.set()
            fut.wait()
        s.add(Collective.BARRIER, 0, 4)  # outside any owner
    finally:
        q.close()
    assert [r.nbytes for r in first] == [10]
    assert [(r.nbytes, r.owner) for r in second] == [(100, mine)]  # landed in another window
    assert [r.nbytes for r in s.owned(mine)] == [10, 100]
    assert s.owned(other) == []
    assert s.records[-1].owner is None
