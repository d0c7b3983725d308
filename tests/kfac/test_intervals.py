"""`"auto"` intervals: the budget rule on given costs, its bounds, and the drift trigger."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from plait.comm.cost import AlphaBeta
from plait.comm.stats import Collective
from plait.kfac import KFAC, KFACConfig
from plait.kfac.costs import KFACCosts
from plait.kfac.intervals import (
    IntervalPlanner,
    Intervals,
    StepCosts,
    choose_intervals,
    overhead_s,
)

#: ResNet-18-sized factor traffic (94 M numbers, packed: about half) among 4 workers.
FACTOR_BYTES = 4 * 47_000_000


def _costs_on(rate_bps: float, *, base_s: float = 6.0, inversion_s: float = 3.0) -> StepCosts:
    link = AlphaBeta.from_rate(rate_bps)
    comm = link.time(Collective.ALL_REDUCE, FACTOR_BYTES, 4)
    return StepCosts(base_step_s=base_s, factor_comm_s=comm, inversion_s=inversion_s)


def test_slow_link_gets_larger_intervals_than_fast() -> None:
    slow = choose_intervals(_costs_on(1e8))
    fast = choose_intervals(_costs_on(1e10))
    assert slow.factor > fast.factor and slow.inv >= fast.inv
    for c, d in ((_costs_on(1e8), slow), (_costs_on(1e10), fast)):
        assert overhead_s(c, d.factor, d.inv) <= 0.25 * c.base_step_s
        # the smallest such: one step fresher inverses would break the budget
        assert d.inv == 1 or all(
            overhead_s(c, f, d.inv - 1) > 0.25 * c.base_step_s
            for f in range(1, d.inv)
            if (d.inv - 1) % f == 0
        )


def test_free_costs_give_every_step_and_a_fixed_interval_is_kept() -> None:
    assert choose_intervals(StepCosts(base_step_s=1.0, factor_comm_s=0, inversion_s=0)) == (
        Intervals(1, 1)
    )
    got = choose_intervals(_costs_on(1e9), factor=4)
    assert got.factor == 4 and got.inv % 4 == 0
    got = choose_intervals(_costs_on(1e9), inv=30)
    assert got.inv == 30 and 30 % got.factor == 0


def test_bounds_hold_and_an_unmeetable_budget_takes_the_largest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hopeless = StepCosts(base_step_s=0.01, factor_comm_s=50.0, inversion_s=80.0)
    with caplog.at_level(logging.WARNING, logger="plait.kfac.intervals"):
        assert choose_intervals(hopeless, max_interval=40) == Intervals(40, 40)
    assert "may lose to its base optimizer" in caplog.text
    for rate in (1e7, 1e8, 1e9, 1e10, 1e12):
        d = choose_intervals(_costs_on(rate), max_interval=100)
        assert 1 <= d.factor <= d.inv <= 100 and d.inv % d.factor == 0
    with pytest.raises(ValueError, match="rho"):
        choose_intervals(hopeless, rho=0)


def test_identical_inputs_decide_identically() -> None:
    c = _costs_on(3e8)
    assert len({choose_intervals(c) for _ in range(5)}) == 1
    assert IntervalPlanner().decide(c) == IntervalPlanner().decide(c)


def test_drift_by_more_than_the_factor_triggers_a_new_decision() -> None:
    planner = IntervalPlanner(drift=2.0, window=3)
    assert planner.drifted(1.0)  # nothing decided yet
    planner.decide(_costs_on(1e9, base_s=4.0))
    for s in (3.0, 5.0, 7.9):
        planner.observe(s)
    assert planner.window_full() and planner.median() == 5.0
    assert not planner.drifted(7.9) and not planner.drifted(2.1)
    assert planner.drifted(8.1) and planner.drifted(1.9)
    planner.observe(100.0)  # the window keeps the latest three
    assert planner.median() == 7.9
    with pytest.raises(ValueError, match="drift"):
        IntervalPlanner(drift=1.0)


def test_config_accepts_auto_only_for_the_intervals() -> None:
    cfg = KFACConfig(factor_interval="AUTO", inv_interval="auto")
    assert cfg.factor_interval == cfg.inv_interval == "auto" and cfg.auto_intervals
    assert not KFACConfig(inv_interval=10).auto_intervals
    with pytest.raises(ValueError, match="inv_interval"):
        KFACConfig(inv_interval="sometimes")
    with pytest.raises(ValueError, match="callable"):
        KFACConfig(factor_interval="auto", inv_interval=lambda s: 10)
    with pytest.raises(ValueError, match="auto_overhead"):
        KFACConfig(auto_overhead=0)


def _train(kfac: KFAC, model: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac.optimizer = opt
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        kfac.step()
        opt.step()


def test_kfac_decides_after_the_first_step_from_its_costs() -> None:
    """Given costs on one process: dear inversions stretch the interval to its bound,
    free ones keep every step; the first step always inverts."""
    torch.manual_seed(0)
    dear = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1.0, flop_s=1e-12)
    cheap = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-30, flop_s=1e-30)
    cfg = KFACConfig(inv_interval="auto", auto_max_interval=50, probe=False)
    for costs, expect in ((dear, Intervals(1, 50)), (cheap, Intervals(1, 1))):
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        kfac = KFAC(model, cfg, costs=costs)
        _train(kfac, model, 4)
        assert kfac.intervals == expect
        assert kfac.at("inv_interval", 4) == expect.inv
        assert kfac.stats.inversions == 4 * (4 if expect.inv == 1 else 1)
        assert kfac.state_dict()["intervals"] == [expect.factor, expect.inv]
        kfac.remove()


def test_kfac_decides_again_when_the_base_step_drifts() -> None:
    """After `auto_window` steps the median base step is compared with the decided one."""
    torch.manual_seed(0)
    costs = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-6, flop_s=1e-12)
    cfg = KFACConfig(inv_interval="auto", auto_window=2, probe=False)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    kfac = KFAC(model, cfg, costs=costs)
    _train(kfac, model, 1)
    planner = kfac._planner
    assert planner is not None and planner.decided_on is not None
    measured = planner.decided_on.base_step_s
    assert measured > 0
    # pretend the decision was made on a step 1000x slower: the next window drifts
    planner.decided_on = StepCosts(base_step_s=1e3 * measured + 1, factor_comm_s=0, inversion_s=0)
    _train(kfac, model, 2)
    assert planner.decided_on.base_step_s < 1e3 * measured
    kfac.remove()


def _decide_on_two_ranks(rank: int, world: int) -> tuple[Intervals, float]:
    import time

    torch.manual_seed(0)
    slow = KFACCosts(link=AlphaBeta.from_rate(1e6), inverse_s_per_n3=1e-7, flop_s=1e-12)
    cfg = KFACConfig(factor_interval="auto", inv_interval="auto", probe=False)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    kfac = KFAC(model, cfg, costs=slow)
    # rank 1's forward is slower: the ranks measure different base steps
    model[1].register_forward_hook(lambda *_: time.sleep(0.05 * rank))
    _train(kfac, model, 2)
    assert kfac._planner is not None and kfac._planner.decided_on is not None
    return kfac.intervals, kfac._planner.decided_on.base_step_s


def test_ranks_that_measure_differently_decide_alike() -> None:
    from plait.testing import run_distributed

    got = run_distributed(_decide_on_two_ranks, world_size=2, timeout_s=120)
    assert got[0] == got[1]
    intervals, base = got[0]
    assert base >= 0.05  # the slowest rank's step was agreed on
    assert intervals.factor > 1  # a 1 Mbit/s link makes the factor all-reduce dear
