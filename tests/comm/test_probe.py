"""The network probe: its timing loop and alpha-beta fit on a simulated clock, and one real
run on two processes."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.comm import probe
from plait.comm.cost import AlphaBeta
from plait.comm.stats import Collective
from plait.testing import run_distributed

WORLD = 4
#: the links the fake collectives below take time on: a different one per kind, so a fit
#: that mixed the kinds' samples up could not recover them
LINKS = {
    Collective.ALL_REDUCE: AlphaBeta(alpha=40e-6, beta=8 / 1e9),
    Collective.ALL_GATHER: AlphaBeta(alpha=90e-6, beta=8 / 5e8),
    Collective.REDUCE_SCATTER: AlphaBeta(alpha=10e-6, beta=8 / 2e9),
    Collective.BROADCAST: AlphaBeta(alpha=70e-6, beta=8 / 1e8),
}


class _Clock:
    """`time.perf_counter` that advances only when a fake collective runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _fake_dist(clock: _Clock, world: int) -> Any:
    """A stand-in for torch.distributed whose collectives take exactly the model's time."""

    def spend(op: Collective, tensor: torch.Tensor) -> None:
        clock.now += LINKS[op].time(op, tensor.numel() * tensor.element_size(), world)

    def all_reduce(buf: torch.Tensor, op: Any = None, group: Any = None) -> None:
        if op is None:  # the MAX over the ranks' timings is not timed: every rank is alike
            spend(Collective.ALL_REDUCE, buf)

    return types.SimpleNamespace(
        is_initialized=lambda: True,
        get_world_size=lambda group=None: world,
        barrier=lambda group=None: None,
        all_reduce=all_reduce,
        all_gather_into_tensor=lambda out, buf, group=None: spend(Collective.ALL_GATHER, buf),
        reduce_scatter_tensor=lambda out, buf, group=None: spend(Collective.REDUCE_SCATTER, buf),
        broadcast=lambda buf, src, group=None: spend(Collective.BROADCAST, buf),
        get_global_rank=lambda group, rank: rank,
        ReduceOp=dist.ReduceOp,
    )


def _fake_ops(clock: _Clock, world: int) -> Any:
    """A stand-in for plait.comm.ops (the probe's door to the collectives), timed alike."""

    def timed(op: Collective) -> Any:
        def run(buf: torch.Tensor, **_: Any) -> None:
            clock.now += LINKS[op].time(op, buf.numel() * buf.element_size(), world)

        return run

    return types.SimpleNamespace(
        all_reduce=timed(Collective.ALL_REDUCE),
        all_gather=timed(Collective.ALL_GATHER),
        reduce_scatter=timed(Collective.REDUCE_SCATTER),
        broadcast=timed(Collective.BROADCAST),
    )


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(probe, "dist", _fake_dist(clock, WORLD))
    monkeypatch.setattr(probe, "ops", _fake_ops(clock, WORLD))
    monkeypatch.setattr(probe, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))


@pytest.mark.usefixtures("simulated")
def test_allreduce_probe_recovers_the_link() -> None:
    sizes = (16 * 1024, 256 * 1024, 2 * 1024 * 1024)
    res = probe.probe_allreduce(sizes=sizes, repeats=3)
    link = LINKS[Collective.ALL_REDUCE]
    assert res.world == WORLD and res.sizes == list(sizes)
    for n, t in zip(sizes, res.seconds, strict=True):
        assert t == pytest.approx(link.time(Collective.ALL_REDUCE, n, WORLD), rel=1e-9)
    # noise-free timings: least squares gives the model back up to rounding
    assert res.model.alpha == pytest.approx(link.alpha, rel=1e-6)
    assert res.model.beta == pytest.approx(link.beta, rel=1e-6)
    # bus bandwidth approaches the link rate as the latency share shrinks
    assert res.busbw_bps == sorted(res.busbw_bps)
    assert res.peak_busbw_bps == res.busbw_bps[-1] < link.bandwidth_bps
    assert res.peak_busbw_bps == pytest.approx(link.bandwidth_bps, rel=0.05)
    out = res.to_dict()
    assert out["alpha_s"] == res.model.alpha and out["bandwidth_bps"] == res.model.bandwidth_bps
    assert len(res.table().splitlines()) == 1 + len(sizes)


@pytest.mark.usefixtures("simulated")
def test_collectives_probe_fits_each_kind_on_its_own() -> None:
    costs = probe.probe_collectives(sizes=(64 * 1024, 1024 * 1024, 4 * 1024 * 1024), repeats=2)
    for op, link in LINKS.items():
        fitted = costs.per_op[op]
        assert fitted.alpha == pytest.approx(link.alpha, rel=1e-6), op
        assert fitted.beta == pytest.approx(link.beta, rel=1e-6), op
    assert costs.default == costs.per_op[Collective.ALL_REDUCE]


def test_probe_needs_two_workers() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="at least two workers"):
        probe.probe_allreduce()
    with pytest.raises(ValueError, match="at least two workers"):
        probe.probe_collectives()


def _probe_job(rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    res = probe.probe_allreduce(sizes=(4 * 1024, 64 * 1024), repeats=2)
    costs = probe.probe_collectives(sizes=(4 * 1024, 64 * 1024), repeats=1)
    return res.to_dict(), costs.to_dict()


def test_probe_on_two_processes() -> None:
    (res0, costs0), (res1, costs1) = run_distributed(_probe_job, world_size=2, timeout_s=60)
    # every rank takes the slowest rank's timings, so all ranks report one result
    assert res0 == res1 and costs0 == costs1
    assert res0["world"] == 2
    assert all(t > 0 for t in res0["seconds"])
    assert res0["alpha_s"] >= 0 and res0["beta_s_per_byte"] >= 0
