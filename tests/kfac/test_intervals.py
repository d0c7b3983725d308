"""`"auto"` intervals: the budget rule on given costs, its bounds, the drift trigger, the
progress-aware controller on synthetic progress curves, and its decisions inside `KFAC`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
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
    AutoIntervals,
    FixedIntervals,
    IntervalPlanner,
    Intervals,
    StepCosts,
    StepPlan,
    StepSample,
    choose_by_progress,
    choose_intervals,
    fit_progress,
    ladder,
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


# ---------------------------------------------------------------------------- progress
def test_fit_progress_recovers_each_candidates_rate_under_a_slowing_curve() -> None:
    """Three candidates in the probe's palindrome, rates 0.30, 0.20, 0.05 per step, on a
    curve that slows down quadratically: the fit returns the rates at the probe's middle."""
    order = [0, 1, 2, 2, 1, 0]
    which = [k for k in order for _ in range(4)]
    rates = [0.30, 0.20, 0.05]
    loss, losses = 5.0, []
    mid = (len(which) - 1) / 2
    for t, k in enumerate(which):
        losses.append(loss)
        # the shared slowing down: the rate falls by 0.004 per step around the middle
        loss -= rates[k] - 0.004 * (t + 0.5 - mid)
    got = fit_progress(losses, which, 3)
    assert got is not None
    assert got.rates == pytest.approx(rates, abs=1e-9)
    assert got.informed
    assert fit_progress(losses[:4], which[:4], 3) is None  # too short to fit
    assert fit_progress([*losses[:-1], math.nan], which, 3) is None  # a loss missing


def test_ladder_stays_within_bounds_and_multiples() -> None:
    assert ladder(2, max_interval=100) == [1, 2, 4]
    assert ladder(1, max_interval=100) == [1, 2]
    assert ladder(64, max_interval=100) == [32, 64, 100]
    assert ladder(6, max_interval=100, unit=3) == [3, 6, 12]


def _costs_of(plan: StepPlan, *, base: float = 1.0, factor: float = 0.1,
              inversion: float = 0.5) -> tuple[float, float | None, float | None]:  # fmt: skip
    f = factor if plan.factor else None
    i = inversion if plan.inversion else None
    return base + (f or 0.0) + (i or 0.0), f, i


def _drive(
    ctl: AutoIntervals,
    steps: int,
    *,
    tau: float | Callable[[int], float],
    rate: Callable[[int], float] = lambda t: 0.05,
    noise: float = 0.0,
    losses: bool = True,
    seed: int = 0,
) -> list[tuple[int, Intervals]]:
    """Train a synthetic model: each step lowers the loss by ``rate(t) * exp(-k / tau)``, k
    the steps since the last inversion (stale curvature makes less progress), plus noise."""
    rng = np.random.default_rng(seed)
    loss, last_inv, changes = 5.0, 0, []
    agreed: list[int] = []

    def agree(values: list[float], op: str) -> list[float]:
        agreed.append(len(values))
        return values

    for t in range(steps):
        plan = ctl.plan(t)
        if plan.inversion:
            last_inv = t
        total, f, i = _costs_of(plan)
        seen = loss + noise * float(rng.normal()) if losses else None
        ctl.observe(t, StepSample(total_s=total, factor_s=f, inversion_s=i, loss=seen))
        new = ctl.update(t, agree, lambda base: StepCosts(base_step_s=base, factor_s=0.0,
                                                          inversion_s=0.0))  # fmt: skip
        if new is not None:
            changes.append((t + 1, new))
        scale = tau(t) if callable(tau) else tau
        loss -= rate(t) * math.exp(-(t - last_inv) / scale)
    return changes


def test_fresh_curvature_that_pays_is_kept_where_the_budget_would_stretch_it() -> None:
    """Curvature that goes stale within a step (tau 1) on a step where a round costs half
    a base step: progress per second is best inverting every step, while the cost budget
    alone (25% overhead) would invert every 4 steps (the GPT's failure at lr 0.1)."""
    budget = choose_intervals(StepCosts(base_step_s=1.0, factor_s=0.1, inversion_s=0.5))
    assert budget.inv == 3
    ctl = AutoIntervals(lazy=True)
    changes = _drive(ctl, 25, tau=1.0)
    assert ctl.decided == Intervals(1, 1) and ctl.progress is not None
    rates = ctl.progress.rates  # candidates 1, 2, 4: each fresher one progresses more
    assert rates[0] > rates[1] > rates[2] > 0
    assert changes == []  # (1, 1) was in force and stays


def test_curvature_that_stays_fresh_stretches_the_interval_phase_by_phase() -> None:
    """Progress that does not care about staleness (tau 1000): every phase takes the
    cheapest candidate, and the next phase's ladder climbs from it."""
    ctl = AutoIntervals(lazy=True)
    changes = _drive(ctl, 400, tau=1000.0)
    invs = [iv.inv for _, iv in changes]
    assert invs[:2] == [4, 8] and invs == sorted(invs)
    assert ctl.history[0][0] == WARMUP_STEPS + 24  # the first probe: 6 blocks of 4 steps


def test_the_decision_follows_the_phase_of_training() -> None:
    """Staleness that hurts early (tau 0.5 for 100 steps) and not later (tau 1000): the
    first phase inverts every step, a later one stretches the interval."""
    ctl = AutoIntervals(lazy=True)
    _drive(ctl, 400, tau=lambda t: 0.5 if t < 100 else 1000.0)
    assert ctl.history[0][1].inv == 1
    later = [iv.inv for step, iv, _ in ctl.history if step > 120]
    assert later and max(later) >= 4


def test_without_measurable_progress_the_cost_budget_decides() -> None:
    """No losses given, or losses that are pure noise: the budget rule's choice."""
    budget = choose_intervals(StepCosts(base_step_s=1.0, factor_s=0.1, inversion_s=0.5))
    quiet = AutoIntervals(lazy=True)
    _drive(quiet, 25, tau=1.0, losses=False)
    assert quiet.progress is None and quiet.decided == budget == Intervals(3, 3)
    noisy = AutoIntervals(lazy=True)
    _drive(noisy, 25, tau=1.0, rate=lambda t: 0.0, noise=0.05)
    assert noisy.progress is not None and not noisy.progress.informed
    assert noisy.decided == budget


def test_noisy_losses_still_show_a_large_difference() -> None:
    """Loss noise of 0.01 per step (a fifth of the fresh rate): the probe still sees that
    stale curvature loses most of the progress, on every seed tried."""
    for seed in range(5):
        ctl = AutoIntervals(lazy=True)
        _drive(ctl, 25, tau=1.0, noise=0.01, seed=seed)
        assert ctl.decided.inv == 1, seed


def test_choose_by_progress_weighs_rate_against_time() -> None:
    costs = StepCosts(base_step_s=1.0, factor_s=0.0, inversion_s=1.0)
    cands = [Intervals(1, 1), Intervals(1, 2), Intervals(1, 4)]  # 2.0, 1.5, 1.25 s a step
    from plait.kfac.intervals import Progress

    # per second: 0.5, 0.6, 0.56: the middle one
    got = choose_by_progress(costs, cands, Progress((1.0, 0.9, 0.7), (0.01, 0.01, 0.01)))
    assert got == Intervals(1, 2)
    # not informed: the budget rule (overhead <= 25%: every 4 steps)
    got = choose_by_progress(costs, cands, Progress((0.01, 0.01, 0.01), (0.1, 0.1, 0.1)))
    assert got == choose_intervals(costs)


def test_ranks_agree_at_the_same_steps_with_lists_of_the_same_length() -> None:
    """Each rank's controller calls `agree` at the same steps, with equally long lists,
    whatever it measured: the collective is matched on every rank."""
    calls = []
    for seed, tau in ((0, 1.0), (1, 1000.0)):
        ctl = AutoIntervals(lazy=False, window=5)
        seen: list[tuple[int, int]] = []
        loss, last = 5.0, 0
        for t in range(120):
            plan = ctl.plan(t)
            last = t if plan.inversion else last
            total, f, i = _costs_of(plan, base=1.0 + 0.1 * seed)
            ctl.observe(t, StepSample(total_s=total, factor_s=f, inversion_s=i, loss=loss))

            def agree(
                values: list[float], op: str, t: int = t, seen: list[Any] = seen
            ) -> list[float]:
                seen.append((t, len(values)))
                return values

            ctl.update(t, agree, lambda b: StepCosts(base_step_s=b, factor_s=0.0, inversion_s=0.0))
            loss -= 0.05 * math.exp(-(t - last) / tau)
        calls.append(seen)
    # the probes' lengths follow the decisions, which differ: the first probe's agree
    # calls (the same for both) are what every rank must match before deciding
    assert calls[0][:2] == calls[1][:2]


def test_fixed_intervals_read_their_schedules_each_step() -> None:
    fixed = FixedIntervals(2, lambda s: 3 if s < 6 else 4)
    plans = [fixed.plan(s) for s in range(9)]
    assert [p.inversion for p in plans] == [s % 3 == 0 if s < 6 else s % 4 == 0 for s in range(9)]
    assert [p.factor for p in plans] == [s % 2 == 0 for s in range(9)]
    assert fixed.decided == Intervals(2, 4)
    with pytest.raises(ValueError, match="inv_interval"):
        FixedIntervals(1, lambda s: 0).plan(0)


# ---------------------------------------------------------------------------- in KFAC
def _train(kfac: KFAC, model: nn.Module, steps: int, *, loss: bool = False) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac.optimizer = opt
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    for _ in range(steps):
        opt.zero_grad()
        out = nn.functional.cross_entropy(model(x), y)
        out.backward()
        kfac.step(out.detach() if loss else None)
        opt.step()


#: steps before the first decision: the warm-up and the first probe (6 blocks of 4)
FIRST = WARMUP_STEPS + 24


def test_kfac_decides_after_the_probe_from_measured_costs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Priced as free, inversions that take 50 ms each (0.2 s a round) stretch the interval
    to its bound (10) beside a 10 ms step; a 100 ms forward with instant inversions keeps
    them every step (no loss given: the cost budget decides). The costs given (free
    inversions) are what the first decision would use without measuring. A simulated
    clock (only the forwards and decompositions advance it) keeps the host's load out:
    with real sleeps, a loaded host's inversions of this tiny model took a third of a
    100 ms step and the second case stretched to 3."""
    import time

    from plait.kfac import preconditioner

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    torch.manual_seed(0)
    free = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-30, flop_s=1e-30)
    cfg = KFACConfig(inv_interval="auto", auto_max_interval=10, probe=False)
    decompose = preconditioner.decompose

    def slow_decompose(*args: object, **kw: object) -> object:
        clock[0] += 0.05
        return decompose(*args, **kw)  # type: ignore[arg-type]

    def advance(seconds: float) -> None:
        clock[0] += seconds

    for slow_inverse, forward_s, expect in ((True, 0.01, 10), (False, 0.1, 1)):
        with monkeypatch.context() as m:
            if slow_inverse:
                m.setattr(preconditioner, "decompose", slow_decompose)
            model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
            model[1].register_forward_hook(lambda *_, s=forward_s: advance(s))
            kfac = KFAC(model, cfg, costs=free)
            _train(kfac, model, FIRST)
        assert kfac.intervals == Intervals(1, expect)
        assert kfac.at("inv_interval", FIRST) == expect
        # the warm-up step and the probe's blocks (inversions every 1, 2, 4, 4, 2, 1
        # steps for 4 steps each: 15 rounds of 4 factors)
        assert kfac.stats.inversions == 4 * 15
        assert kfac.state_dict()["intervals"] == [1, expect]
        kfac.remove()


@pytest.mark.parametrize("sync", ["eager", "lazy"])
def test_the_factor_all_reduce_counts_where_it_is_waited_for(
    sync: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager sync all-reduces the factors of every update, lazy sync only the running
    factors of an inversion round: a 0.2 s wait for that exchange (stood in for by a slow
    end of each step that asks to communicate) is the factor update's cost under eager, the
    round's under lazy. A simulated clock (each forward 0.05 s, each such wait 0.2 s,
    nothing else) keeps the host's load out: with real sleeps, a host running five test
    suites at once measured plain steps of 0.08-0.23 s and rounds of 0.1-0.45 s for this
    tiny model, and the medians' differences missed the wait."""
    import time

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    torch.manual_seed(0)
    free = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-30, flop_s=1e-30)
    cfg = KFACConfig(factor_interval="auto", inv_interval="auto", sync=sync, probe=False)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model[1].register_forward_hook(lambda *_: clock.__setitem__(0, clock[0] + 0.05))
    kfac = KFAC(model, cfg, costs=free)
    begin_step, end_step = kfac.pipeline.begin_step, kfac.pipeline.end_step
    asked: list[bool] = []

    def begin(*, communicate: bool, decay: float) -> None:
        asked.append(communicate)  # one process never communicates: remember the request
        begin_step(communicate=communicate, decay=decay)

    def slow_end_step() -> None:
        if asked and asked[-1]:
            clock[0] += 0.2
        end_step()

    kfac.pipeline.begin_step = begin  # type: ignore[method-assign]
    kfac.pipeline.end_step = slow_end_step  # type: ignore[method-assign]
    _train(kfac, model, FIRST)
    assert isinstance(kfac.controller, AutoIntervals)
    costs = kfac.controller.planner.decided_on
    assert costs is not None
    assert costs.base_step_s == pytest.approx(0.05)
    if sync == "lazy":
        assert costs.inversion_s == pytest.approx(0.2) and costs.factor_s == 0.0
    else:
        assert costs.factor_s == pytest.approx(0.2) and costs.inversion_s == 0.0
    kfac.remove()


def test_kfac_decides_again_when_the_base_step_drifts() -> None:
    """After `auto_window` steps the median base step is compared with the decided one."""
    torch.manual_seed(0)
    costs = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-6, flop_s=1e-12)
    cfg = KFACConfig(inv_interval="auto", auto_window=2, probe=False)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    kfac = KFAC(model, cfg, costs=costs)
    _train(kfac, model, FIRST)
    assert isinstance(kfac.controller, AutoIntervals)
    planner = kfac.controller.planner
    assert planner.decided_on is not None
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


def test_kfac_hands_the_loss_to_the_rule() -> None:
    """Given the loss, `KFAC.step` lets the controller fit progress after its probe."""
    torch.manual_seed(0)
    costs = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-6, flop_s=1e-12)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    kfac = KFAC(model, KFACConfig(inv_interval="auto", kl_clip=None, probe=False), costs=costs)
    _train(kfac, model, FIRST, loss=True)
    assert isinstance(kfac.controller, AutoIntervals) and kfac.controller.progress is not None
    assert len(kfac.controller.progress.rates) == 3
    kfac.remove()


def _decide_on_two_ranks(rank: int, world: int) -> tuple[Intervals, float, list[float]]:
    import time

    torch.manual_seed(0)
    costs = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-7, flop_s=1e-12)
    cfg = KFACConfig(factor_interval="auto", inv_interval="auto", probe=False)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    kfac = KFAC(model, cfg, costs=costs)
    # rank 1's forward is slower, rank 0's factor computations are: the ranks measure
    # different base steps and factor updates (and see different losses: own shards)
    model[1].register_forward_hook(lambda *_: time.sleep(0.02 * rank))
    for layer in kfac.layers.values():
        a_sum = layer.a_sum

        def slow_a_sum(*args: Any, _a_sum: Any = a_sum, **kw: Any) -> Any:
            time.sleep(0.012 * (1 - rank))
            return _a_sum(*args, **kw)

        layer.a_sum = slow_a_sum  # type: ignore[method-assign]
    torch.manual_seed(rank)
    _train(kfac, model, FIRST, loss=True)
    ctl = kfac.controller
    assert isinstance(ctl, AutoIntervals) and ctl.planner.decided_on is not None
    rates = list(ctl.progress.rates) if ctl.progress is not None else []
    return kfac.intervals, ctl.planner.decided_on.base_step_s, rates


def test_ranks_that_measure_differently_decide_alike() -> None:
    from plait.testing import run_distributed

    got = run_distributed(_decide_on_two_ranks, world_size=2, timeout_s=120)
    assert got[0] == got[1]
    intervals, base, rates = got[0]
    assert base >= 0.02  # the slowest rank's step was agreed on
    assert len(rates) == 3  # the losses, agreed, gave one rate per candidate
    # rank 0's 24 ms factor update (two layers), against the 5 ms budget of rank 1's 20 ms
    # step: factor updates are spread out
    assert intervals.factor > 1
