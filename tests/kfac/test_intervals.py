"""`"auto"` intervals: the budget rule on given costs, its bounds, and the drift trigger."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from plait.comm.cost import AlphaBeta
from plait.comm.stats import Collective
from plait.kfac import KFAC, KFACConfig
from plait.kfac.costs import KFACCosts
from plait.kfac.intervals import (
    PROBE_ROUNDS,
    WARMUP_STEPS,
    IntervalPlanner,
    Intervals,
    StepCosts,
    choose_intervals,
    overhead_s,
    probe_intervals,
)

#: ResNet-18-sized factor traffic (94 M numbers, packed: about half) among 4 workers.
FACTOR_BYTES = 4 * 47_000_000


def _costs_on(rate_bps: float, *, base_s: float = 6.0, inversion_s: float = 3.0) -> StepCosts:
    link = AlphaBeta.from_rate(rate_bps)
    comm = link.time(Collective.ALL_REDUCE, FACTOR_BYTES, 4)
    return StepCosts(base_step_s=base_s, factor_s=comm, inversion_s=inversion_s)


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
    assert choose_intervals(StepCosts(base_step_s=1.0, factor_s=0, inversion_s=0)) == (
        Intervals(1, 1)
    )
    got = choose_intervals(_costs_on(1e9), factor=4)
    assert got.factor == 4 and got.inv % 4 == 0
    got = choose_intervals(_costs_on(1e9), inv=30)
    assert got.inv == 30 and 30 % got.factor == 0


def test_bounds_hold_and_an_unmeetable_budget_takes_the_largest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hopeless = StepCosts(base_step_s=0.01, factor_s=50.0, inversion_s=80.0)
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
    decided = StepCosts(base_step_s=4.0, factor_s=1.0, inversion_s=2.0)
    assert planner.drifted(decided)  # nothing decided yet
    planner.decide(decided)
    for s in (3.0, 5.0, 7.9):
        planner.observe(s)
    assert planner.median() == 5.0

    def base(b: float) -> StepCosts:
        return StepCosts(base_step_s=b, factor_s=1.0, inversion_s=2.0)

    assert not planner.drifted(base(7.9)) and not planner.drifted(base(2.1))
    assert planner.drifted(base(8.1)) and planner.drifted(base(1.9))
    # any part drifts: inversions four times dearer
    assert planner.drifted(StepCosts(base_step_s=4.0, factor_s=1.0, inversion_s=8.0))
    planner.observe(100.0)  # the window keeps the latest three
    assert planner.median() == 7.9
    with pytest.raises(ValueError, match="drift"):
        IntervalPlanner(drift=1.0)


def test_timed_parts_stand_in_until_the_kinds_of_step_are_seen() -> None:
    """Only inversion steps seen (intervals (1, 1)): nothing to take a difference from, so
    K-FAC's own timed parts price the step, and before any step the prices do."""
    planner = IntervalPlanner(window=3)
    priced = StepCosts(base_step_s=1.0, factor_s=0.5, inversion_s=1e-4)
    assert planner.costs(priced) == priced  # nothing measured yet
    planner.observe(2.0, factor_s=0.3, inversion_s=0.5)
    planner.observe(4.0, factor_s=0.3, inversion_s=0.9)
    planner.observe(3.0, factor_s=0.1, inversion_s=0.7)
    # splits: base 1.2, 2.8, 2.2 -> 2.2; factor 0.3, 0.3, 0.1 -> 0.3; inversions -> 0.7
    got = planner.costs(priced)
    assert got == pytest.approx(StepCosts(base_step_s=2.2, factor_s=0.3, inversion_s=0.7))


def test_steps_of_each_kind_price_by_difference() -> None:
    """A plain step of 3 s, factor steps of 3.5 s, inversion steps of 6 s: the factor update
    costs 0.5 s and the round 2.5 s, whatever K-FAC's own timed parts say (here they miss
    the 2 s by which the round's traffic slowed the backward pass)."""
    planner = IntervalPlanner(window=5)
    priced = StepCosts(base_step_s=1.0, factor_s=0.5, inversion_s=1e-4)
    for step in range(12):  # the probe's pattern: intervals (2, 4)
        if step % 4 == 0:
            planner.observe(6.0, factor_s=0.2, inversion_s=0.3)
        elif step % 2 == 0:
            planner.observe(3.5, factor_s=0.2)
        else:
            planner.observe(3.0)
    assert planner.median() == 3.0
    assert planner.costs(priced) == StepCosts(base_step_s=3.0, factor_s=0.5, inversion_s=2.5)
    # no factor-only steps (intervals (f, f)): a round is the difference with a plain step
    # and the timed factor part
    planner = IntervalPlanner(window=5)
    for step in range(6):
        if step % 2:
            planner.observe(3.0)
        else:
            planner.observe(6.0, factor_s=0.2, inversion_s=0.3)
    assert planner.costs(priced) == pytest.approx(
        StepCosts(base_step_s=3.0, factor_s=0.2, inversion_s=2.8)
    )
    # the lazy probe's pattern, (1, 2): every step updates the factors, so a factor step
    # less its timed factor part (0.2 s) is the base step, and a round costs the difference
    # with a factor step, traffic included
    planner = IntervalPlanner(window=5)
    for step in range(6):
        if step % 2:
            planner.observe(3.2, factor_s=0.2)
        else:
            planner.observe(6.0, factor_s=0.2, inversion_s=0.3)
    assert planner.costs(priced) == pytest.approx(
        StepCosts(base_step_s=3.0, factor_s=0.2, inversion_s=2.8)
    )
    # noise that makes a kind look cheaper than the plain step prices it at zero
    planner = IntervalPlanner(window=5)
    for total in (3.0, 2.9):
        planner.observe(total)
        planner.observe(total - 0.2, factor_s=0.1)
    assert planner.costs(priced).factor_s == 0.0


def test_the_probe_has_every_kind_of_step_and_keeps_a_fixed_interval() -> None:
    """Under eager sync the probe has plain, factor and inversion steps."""

    def kinds(iv: Intervals) -> set[str]:
        steps = range(WARMUP_STEPS, WARMUP_STEPS + PROBE_ROUNDS * iv.inv)
        return {
            "inv" if t % iv.inv == 0 else "factor" if t % iv.factor == 0 else "plain" for t in steps
        }

    assert probe_intervals() == Intervals(2, 4)
    assert kinds(probe_intervals()) == {"plain", "factor", "inv"}
    assert probe_intervals(factor=3) == Intervals(3, 6)
    assert kinds(probe_intervals(factor=3)) == {"plain", "factor", "inv"}
    assert probe_intervals(factor=1) == Intervals(1, 2)  # every step updates the factors
    assert probe_intervals(inv=12) == Intervals(2, 12)
    assert probe_intervals(inv=7) == Intervals(7, 7)
    assert probe_intervals(inv=1) == Intervals(1, 1)
    assert probe_intervals(factor=2, inv=8) == Intervals(2, 8)
    # lazy sync: factor steps between rounds have no traffic, so no plain step is needed
    assert probe_intervals(lazy=True) == Intervals(1, 2)
    assert probe_intervals(inv=12, lazy=True) == Intervals(1, 12)
    assert probe_intervals(factor=3, lazy=True) == Intervals(3, 6)


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


def test_kfac_decides_after_the_probe_from_measured_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Priced as free, inversions that take 100 ms each stretch the interval to its bound;
    a 50 ms forward makes the same inversions cheap enough for every step. The costs given
    (free inversions) are what the first decision would use without measuring."""
    import time

    from plait.kfac import preconditioner

    torch.manual_seed(0)
    free = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-30, flop_s=1e-30)
    cfg = KFACConfig(inv_interval="auto", auto_max_interval=50, probe=False)
    decompose = preconditioner.decompose

    def slow_decompose(*args: object, **kw: object) -> object:
        time.sleep(0.1)
        return decompose(*args, **kw)  # type: ignore[arg-type]

    for slow_inverse, slow_forward, expect in ((True, 0.0, 50), (False, 0.05, 1)):
        with monkeypatch.context() as m:
            if slow_inverse:
                m.setattr(preconditioner, "decompose", slow_decompose)
            model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
            model[1].register_forward_hook(lambda *_, s=slow_forward: time.sleep(s))
            kfac = KFAC(model, cfg, costs=free)
            _train(kfac, model, 8)
        assert kfac.intervals == Intervals(1, expect)
        assert kfac.at("inv_interval", 8) == expect
        # step 0 inverts (WARMUP_STEPS), the probe at (1, 2) runs steps 1 to 4
        # (inverting at 2 and 4), then every `expect` steps from step 5
        assert kfac.stats.inversions == 4 * (6 if expect == 1 else 3)
        assert kfac.state_dict()["intervals"] == [1, expect]
        kfac.remove()


@pytest.mark.parametrize("sync", ["eager", "lazy"])
def test_the_factor_all_reduce_counts_where_it_is_waited_for(sync: str) -> None:
    """Eager sync all-reduces the factors of every update, lazy sync only the running
    factors of an inversion round: a 0.2 s wait for that exchange (stood in for by a slow
    end of each step that asks to communicate) is the factor update's cost under eager, the
    round's under lazy. (0.2 s: far above what the tiny model's own parts take on a loaded
    2-core host.)"""
    import time

    torch.manual_seed(0)
    free = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-30, flop_s=1e-30)
    cfg = KFACConfig(factor_interval="auto", inv_interval="auto", sync=sync, probe=False)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    kfac = KFAC(model, cfg, costs=free)
    begin_step, end_step = kfac.pipeline.begin_step, kfac.pipeline.end_step
    asked: list[bool] = []

    def begin(*, communicate: bool, decay: float) -> None:
        asked.append(communicate)  # one process never communicates: remember the request
        begin_step(communicate=communicate, decay=decay)

    def slow_end_step() -> None:
        if asked and asked[-1]:
            time.sleep(0.2)
        end_step()

    kfac.pipeline.begin_step = begin  # type: ignore[method-assign]
    kfac.pipeline.end_step = slow_end_step  # type: ignore[method-assign]
    _train(kfac, model, WARMUP_STEPS + PROBE_ROUNDS * probe_intervals().inv)
    assert kfac._planner is not None
    costs = kfac._planner.decided_on
    assert costs is not None
    if sync == "lazy":
        assert costs.inversion_s >= 0.15 > costs.factor_s
    else:
        assert costs.factor_s >= 0.15 > costs.inversion_s
    kfac.remove()


def test_kfac_decides_again_when_the_base_step_drifts() -> None:
    """After `auto_window` steps the median base step is compared with the decided one."""
    torch.manual_seed(0)
    costs = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-6, flop_s=1e-12)
    cfg = KFACConfig(inv_interval="auto", auto_window=2, probe=False)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    kfac = KFAC(model, cfg, costs=costs)
    _train(kfac, model, WARMUP_STEPS + PROBE_ROUNDS * 2)  # probe (1, 2)
    planner = kfac._planner
    assert planner is not None and planner.decided_on is not None
    measured = planner.decided_on.base_step_s
    assert measured > 0
    # pretend the decision was made on a step 1000x slower: the next window drifts
    planner.decided_on = StepCosts(
        base_step_s=1e3 * measured + 1,
        factor_s=planner.decided_on.factor_s,
        inversion_s=planner.decided_on.inversion_s,
    )
    _train(kfac, model, 2)
    assert planner.decided_on.base_step_s < 1e3 * measured
    kfac.remove()


def _decide_on_two_ranks(rank: int, world: int) -> tuple[Intervals, float]:
    import time

    torch.manual_seed(0)
    costs = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-7, flop_s=1e-12)
    cfg = KFACConfig(factor_interval="auto", inv_interval="auto", probe=False)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    kfac = KFAC(model, cfg, costs=costs)
    # rank 1's forward is slower, rank 0's factor computations are: the ranks measure
    # different base steps and factor updates
    model[1].register_forward_hook(lambda *_: time.sleep(0.05 * rank))
    for layer in kfac.layers.values():
        a_sum = layer.a_sum

        def slow_a_sum(*args: Any, _a_sum: Any = a_sum, **kw: Any) -> Any:
            time.sleep(0.03 * (1 - rank))
            return _a_sum(*args, **kw)

        layer.a_sum = slow_a_sum  # type: ignore[method-assign]
    _train(kfac, model, WARMUP_STEPS + PROBE_ROUNDS * probe_intervals().inv)
    assert kfac._planner is not None and kfac._planner.decided_on is not None
    return kfac.intervals, kfac._planner.decided_on.base_step_s


def test_ranks_that_measure_differently_decide_alike() -> None:
    from plait.testing import run_distributed

    got = run_distributed(_decide_on_two_ranks, world_size=2, timeout_s=120)
    assert got[0] == got[1]
    intervals, base = got[0]
    assert base >= 0.05  # the slowest rank's step was agreed on
    # rank 0's 60 ms factor update, against the 12.5 ms budget of rank 1's 50 ms step
    assert intervals.factor > 1
