"""Trial runs: the order layouts are tried in, the memory guard, and metered trials."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.comm import AlphaBeta
from plait.parallel.memory import MemoryEstimate
from plait.parallel.plan import Plan
from plait.parallel.planner import (
    Estimate,
    Trial,
    layouts,
    optimizer_like,
    optimizer_states_of,
    select,
    shortlist,
    stand_in_optimizer,
)
from plait.testing import run_distributed

MiB = 1 << 20


def _estimate(text: str, *, fits: bool = True) -> Estimate:
    mem = MemoryEstimate(params=0, grads=0, optimizer=0, buffers=0, activations=0)
    return Estimate(plan=Plan.parse(text), memory=mem, compute_s=1.0, comm_s={}, fits=fits)


def test_layouts_take_the_best_plan_of_each_layout_in_order() -> None:
    estimates = [
        _estimate("dp=2"),
        _estimate("pp=2,schedule=gpipe"),
        _estimate("pp=2,schedule=1f1b"),  # the same layout as the one before
        _estimate("tp=2", fits=False),  # does not fit: never tried
        _estimate("dp=2,zero=3"),
    ]
    assert [p.describe() for p in layouts(estimates)] == [
        "dp=2",
        "pp=2,schedule=gpipe",
        "dp=2,zero=3",
    ]
    assert [p.describe() for p in shortlist(estimates, 2)] == ["dp=2", "pp=2,schedule=gpipe"]


def _fake(trials: dict[str, Trial]) -> tuple[list[str], Any]:
    ran: list[str] = []

    def run(plan: Plan) -> Trial:
        ran.append(plan.describe())
        return trials[plan.describe()]

    return ran, run


def test_select_takes_the_fastest_that_fits() -> None:
    plans = [Plan.parse(t) for t in ("dp=2", "pp=2", "tp=2")]
    ran, run = _fake(
        {"dp=2": Trial(0.3, 50 * MiB), "pp=2": Trial(0.2, 60 * MiB), "tp=2": Trial(0.1, 1)}
    )
    best, trials = select(plans, run, trials=2, memory_bytes=None)
    assert best is not None and best.describe() == "pp=2"
    assert ran == ["dp=2", "pp=2"]  # two fitting trials were asked for: tp=2 never ran
    assert set(trials) == {"dp=2", "pp=2"}


def test_a_plan_metered_over_the_budget_is_replaced_by_the_next_layout() -> None:
    plans = [Plan.parse(t) for t in ("dp=2", "pp=2", "tp=2")]
    ran, run = _fake(
        {
            "dp=2": Trial(0.1, 84 * MiB),  # the fastest, but over an 80 MiB budget
            "pp=2": Trial(0.3, 70 * MiB),
            "tp=2": Trial(0.2, 79 * MiB),
        }
    )
    best, trials = select(plans, run, trials=2, memory_bytes=80 * MiB)
    assert best is not None and best.describe() == "tp=2"
    assert ran == ["dp=2", "pp=2", "tp=2"]  # the over-budget trial did not count
    assert trials["dp=2"].peak_bytes == 84 * MiB


def test_select_returns_none_when_nothing_fits() -> None:
    ran, run = _fake({"dp=2": Trial(0.1, 90 * MiB), "pp=2": Trial(0.2, 81 * MiB)})
    best, trials = select(
        [Plan.parse("dp=2"), Plan.parse("pp=2")], run, trials=4, memory_bytes=80 * MiB
    )
    assert best is None and set(trials) == {"dp=2", "pp=2"}
    assert ran == ["dp=2", "pp=2"]  # every candidate was tried before giving up


def test_optimizer_states() -> None:
    w = [torch.nn.Parameter(torch.zeros(2))]
    factory, states = optimizer_like(torch.optim.SGD(w, lr=0.1, momentum=0.9))
    built = factory([torch.nn.Parameter(torch.zeros(3))])
    assert states == 1 and isinstance(built, torch.optim.SGD)
    assert built.defaults["momentum"] == 0.9 and built.defaults["lr"] == 0.1
    assert optimizer_like(torch.optim.SGD(w, lr=0.1))[1] == 0
    assert optimizer_like(torch.optim.AdamW(w))[1] == 2
    assert optimizer_states_of("adamw") == 2 and optimizer_states_of("sgd-plain") == 0
    assert optimizer_states_of("someone-elses") == 2  # unknown: the most
    assert isinstance(stand_in_optimizer(2)(w), torch.optim.AdamW)
    assert stand_in_optimizer(1)(w).defaults["momentum"] == 0.9


# ----------------------------------------------------------------- in a job (2 ranks)
def _mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    from plait.workloads import get_workload

    wl = get_workload("mlp")
    data = wl.bench_data(8)
    torch.manual_seed(0)
    model = wl.model(data.info, bench=True)
    xs, ys = zip(*[data.train[i] for i in range(4)], strict=True)
    return model, (torch.stack(list(xs)), torch.stack(list(ys)))


def _job(rank: int, world: int) -> dict[str, Any]:
    import plait.parallel.planner.auto as auto
    from plait.parallel.api import cross_entropy
    from plait.parallel.planner import auto_plan, run_trial

    model, sample = _mlp()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    out: dict[str, Any] = {"params": params}
    for text in ("dp=2", "dp=2,zero=3"):
        trial = run_trial(
            model,
            Plan.parse(text),
            sample=sample,
            global_batch=8,
            loss_fn=cross_entropy,
            steps=1,
            optimizer=stand_in_optimizer(2),
        )
        out[text] = trial

    real = auto.run_trial
    first: list[str] = []

    def inflated(model: Any, plan: Plan, **kw: Any) -> Trial:
        """The real trial, reported 1 GiB over for the first plan tried."""
        trial = real(model, plan, **kw)
        if not first:
            first.append(plan.describe())
            return Trial(trial.step_s, trial.peak_bytes + (1 << 30))
        return trial

    auto.run_trial = inflated  # this worker process only
    net = AlphaBeta.from_rate(1e9)
    choice = auto_plan(model, sample=sample, memory_bytes=1 << 30, network=net, trials=2)
    out["first"], out["chosen"] = first[0], choice.plan.describe()
    out["metered"], out["reason"] = choice.metered, choice.reason

    def always_over(model: Any, plan: Plan, **kw: Any) -> Trial:
        return Trial(real(model, plan, **kw).step_s, 2 << 30)

    auto.run_trial = always_over
    try:
        auto_plan(model, sample=sample, memory_bytes=1 << 30, network=net, trials=2)
    except ValueError as exc:
        out["error"] = str(exc)
    auto.run_trial = real
    return out


@pytest.fixture(scope="module")
def job() -> list[dict[str, Any]]:
    return run_distributed(_job, world_size=2, timeout_s=300)


def test_trials_meter_the_plans_peak(job: list[dict[str, Any]]) -> None:
    r = job[0]
    plain, sharded = r["dp=2"], r["dp=2,zero=3"]
    assert job[1]["dp=2"] == plain  # reduced over ranks: every rank holds the same figures
    # parameters, gradients and AdamW's two moments, unsharded: at least four copies
    assert plain.peak_bytes >= 4 * r["params"]
    # ZeRO-3 shards all four over 2 ranks; the step's gathered copies stay below that
    assert sharded.peak_bytes < plain.peak_bytes
    assert plain.step_s > 0 and sharded.step_s > 0


def test_a_plan_metered_over_the_budget_is_not_chosen(job: list[dict[str, Any]]) -> None:
    r = job[0]
    assert r["chosen"] != r["first"] and job[1]["chosen"] == r["chosen"]
    assert r["metered"][r["first"]] > 1 << 30
    assert "metered over the budget in trials and were passed over" in r["reason"]
    assert r["first"] in r["reason"]


def test_no_plan_metered_within_the_budget_raises(job: list[dict[str, Any]]) -> None:
    assert "no plan fits in 1.00 GiB" in job[0]["error"]
    assert "metered over it in trial runs" in job[0]["error"]
