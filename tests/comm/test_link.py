"""The modelled link: gloo's algorithms priced on a shaped TCP link, one wire per process,
futures completed no earlier than the wire allows, and collectives that take that time."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from plait.comm import Collective, ops
from plait.comm import link as mlink
from plait.comm.cost import Algorithms, AlphaBeta
from plait.testing import run_distributed


def test_link_model_counts_tcp_framing_and_delay() -> None:
    m = mlink.link_model(1e8, latency_s=0.002)
    assert m.beta == pytest.approx(8 * 1514 / 1448 / 1e8)
    assert m.alpha == pytest.approx(mlink.LINK_ALPHA_S + 0.002)
    with pytest.raises(ValueError, match="rate must be > 0"):
        mlink.link_model(0)


def test_gloo_algorithms_tree_broadcast_and_reduce_scatter_as_all_reduce() -> None:
    ab = AlphaBeta(alpha=1e-3, beta=1e-8)
    n = 1_000_000
    # binomial tree over 4 ranks: the root sends the buffer twice, one level after the other
    assert ab.time_as(Algorithms.GLOO, Collective.BROADCAST, n, 4) == pytest.approx(
        2 * (1e-3 + n * 1e-8)
    )
    assert ab.time_as(Algorithms.GLOO, Collective.REDUCE_SCATTER, n, 4) == pytest.approx(
        ab.time(Collective.ALL_REDUCE, n, 4)
    )
    assert ab.time_as(Algorithms.RING, Collective.BROADCAST, n, 4) == ab.time(
        Collective.BROADCAST, n, 4
    )


def test_transfers_queue_on_one_wire() -> None:
    link = mlink.ModelledLink(AlphaBeta(alpha=0.0, beta=1e-6))
    end1 = link.reserve(Collective.ALL_REDUCE, 1000, 2, issued_at=10.0)  # 1000 wire bytes
    end2 = link.reserve(Collective.ALL_REDUCE, 1000, 2, issued_at=10.0)  # waits for the first
    end3 = link.reserve(Collective.ALL_REDUCE, 1000, 2, issued_at=20.0)  # idle wire: starts now
    assert (end1, end2, end3) == pytest.approx((10.001, 10.002, 20.001))
    assert link.modelled_s == pytest.approx(0.003)


def test_delay_completes_at_the_wire_end_and_fails_at_once() -> None:
    link = mlink.ModelledLink(AlphaBeta(alpha=0.0, beta=0.0))
    done: torch.futures.Future[Any] = torch.futures.Future()
    done.set_result(7)
    t0 = time.perf_counter()
    late = link.delay(done, ends_at=t0 + 0.05)
    assert late.wait() == 7
    assert time.perf_counter() - t0 >= 0.05
    failed: torch.futures.Future[Any] = torch.futures.Future()
    out = link.delay(failed, ends_at=time.perf_counter() + 60)
    failed.set_exception(RuntimeError("peer lost"))
    with pytest.raises(RuntimeError, match="peer lost"):
        out.wait()  # not after a minute: a failure is never delayed


def test_many_transfers_in_flight_complete_in_wire_order() -> None:
    link = mlink.ModelledLink(AlphaBeta(alpha=0.0, beta=0.0))
    t0 = time.perf_counter()
    order: list[int] = []
    futs = []
    for i, delay in enumerate((0.06, 0.02, 0.04, 0.04)):  # two due at the same time
        done: torch.futures.Future[Any] = torch.futures.Future()
        late = link.delay(done, ends_at=t0 + delay)
        late.add_done_callback(lambda _f, i=i: order.append(i))
        done.set_result(i)
        futs.append(late)
    assert [f.wait() for f in futs] == [0, 1, 2, 3]
    # a future wakes its waiters before it runs its callbacks: the last may still be due
    deadline = time.perf_counter() + 5.0
    while len(order) < len(futs) and time.perf_counter() < deadline:
        time.sleep(0.001)
    assert order == [1, 2, 3, 0]  # by due time, ties in issue order


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mlink.LINK_ENV, raising=False)
    assert mlink.from_env() is None
    monkeypatch.setenv(mlink.LINK_ENV, "tc")
    assert mlink.from_env() is None
    monkeypatch.setenv(mlink.LINK_ENV, "model")
    monkeypatch.delenv(mlink.RATE_ENV, raising=False)
    with pytest.raises(ValueError, match="needs the link's rate"):
        mlink.from_env()
    monkeypatch.setenv(mlink.RATE_ENV, "100mbit")
    monkeypatch.setenv(mlink.LATENCY_ENV, "1ms")
    link = mlink.from_env()
    assert link is not None and link.model.alpha == pytest.approx(mlink.LINK_ALPHA_S + 1e-3)
    monkeypatch.setenv(mlink.LINK_ENV, "wire")
    with pytest.raises(ValueError, match="expected model, tc or none"):
        mlink.from_env()


#: 1 MB of float32 all-reduced by 2 ranks on a modelled 80 Mbit/s link: 1 MB sent per rank,
#: 0.105 s with framing; loopback alone does it in about a millisecond.
_RATE, _N = "80mbit", 250_000


def _timed_collectives(rank: int, world: int) -> dict[str, float]:
    x = torch.full((_N,), float(rank + 1))
    ops.all_reduce(x, async_op=False)  # connect
    t0 = time.perf_counter()
    ops.all_reduce(x, async_op=False)
    one = time.perf_counter() - t0
    # two in flight at once queue on the wire; meanwhile this thread computes
    t0 = time.perf_counter()
    futs = [ops.all_reduce(torch.ones(_N)) for _ in range(2)]
    issued = time.perf_counter() - t0
    ops.wait(futs[0])
    first = time.perf_counter() - t0
    ops.wait(futs[1])
    both = time.perf_counter() - t0
    return {"one": one, "issued": issued, "first": first, "both": both, "sum": float(x[0])}


def test_collectives_take_the_modelled_time_and_queue() -> None:
    out = run_distributed(
        _timed_collectives,
        world_size=2,
        env={mlink.LINK_ENV: "model", mlink.RATE_ENV: _RATE},
        timeout_s=60,
    )
    model = mlink.link_model(80e6).time_as(Algorithms.GLOO, Collective.ALL_REDUCE, 4 * _N, 2)
    for r in out:
        assert r["sum"] == 6.0  # (1 + 2), all-reduced twice: the real result
        # never faster than the wire; the slack is two loaded ranks on two cores
        assert model <= r["one"] < model + 0.1
        assert r["issued"] < model / 4  # issuing does not wait for the wire
        assert r["first"] >= model and r["both"] >= 2 * model  # one wire, in issue order
