"""The planner: candidates, memory model against the meter, choices, the `plait plan` table."""

from __future__ import annotations

import pytest
import torch

from plait.bench.scorecard import markdown, score
from plait.cli import main as cli_main
from plait.comm import AlphaBeta
from plait.parallel import Plan, Schedule, ZeroStage, adapter_for
from plait.parallel.memory import (
    PeakMemory,
    estimate_memory,
    measure_activations,
    model_state_bytes,
    parse_bytes,
)
from plait.parallel.planner import (
    ComputeProfile,
    Hardware,
    candidate_plans,
    choose,
    estimate,
    profile_model,
)
from tests.parallel.common import batches, gpt, loss_fn

GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def profile() -> ComputeProfile:
    xs, ys = batches(1)
    return profile_model(gpt(), xs[0], ys[0], loss_fn=loss_fn, repeats=1)


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes(1000) == 1000
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")


def test_candidates_are_valid_plans() -> None:
    model = gpt()
    dims = adapter_for(model).dims(model)
    plans = list(candidate_plans(4, dims, global_batch=GLOBAL_BATCH))
    assert len(plans) > 50
    for plan in plans:
        plan.validate(world=4, dims=dims)  # raises if the planner proposed an invalid plan
    assert {(p.dp, p.tp, p.pp) for p in plans} == {
        (4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)
    }  # fmt: skip


def test_zero3_divides_model_state(profile: ComputeProfile) -> None:
    model = gpt()
    dims = adapter_for(model).dims(model)
    plain = estimate_memory(Plan(dp=4), dims=dims, acts=profile.acts, global_batch=GLOBAL_BATCH)
    zero3 = estimate_memory(Plan(dp=4, zero=ZeroStage.PARAMETERS), dims=dims, acts=profile.acts,
                            global_batch=GLOBAL_BATCH)  # fmt: skip
    assert zero3.model_state == pytest.approx(plain.model_state / 4)


def test_memory_model_bounds_the_measured_peak(profile: ComputeProfile) -> None:
    """The model may overestimate (it must never let a plan run out), but not wildly."""
    xs, ys = batches(2)
    meter = PeakMemory()
    with meter:
        model = gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i in range(2):
            if i == 1:
                meter.reset_peak()  # the steady step, optimizer states allocated
            opt.zero_grad()
            loss_fn(model(xs[i]), ys[i]).backward()
            opt.step()
    dims = adapter_for(model).dims(model)
    est = estimate_memory(Plan(dp=1), dims=dims, acts=profile.acts, global_batch=xs.shape[1])
    assert model_state_bytes(model, opt) == pytest.approx(est.model_state, rel=0.01)
    assert meter.peak <= est.total <= 2 * meter.peak


def test_activations_scale_with_batch() -> None:
    xs, ys = batches(1)
    small = measure_activations(gpt(), xs[0][:2], ys[0][:2], loss_fn)
    large = measure_activations(gpt(), xs[0], ys[0], loss_fn)
    assert small.block > 0
    assert large.block == pytest.approx(small.block, rel=0.1)  # bytes per sample


def test_choice_respects_memory_and_network(profile: ComputeProfile) -> None:
    model = gpt()
    dims = adapter_for(model).dims(model)
    free = Hardware(world=4, network=AlphaBeta(alpha=0.0, beta=0.0))
    # a free network and a device per rank: data parallelism has nothing to lose
    best = choose(dims=dims, profile=profile, hardware=free, global_batch=GLOBAL_BATCH)
    assert (best.plan.dp, best.plan.ac) == (4, False)
    # a tight memory: the choice fits, the faster plans are rejected as out of memory
    net = AlphaBeta.from_rate(1e9)
    fastest = choose(dims=dims, profile=profile, global_batch=GLOBAL_BATCH,
                     hardware=Hardware(world=4, network=net))  # fmt: skip
    tight = Hardware(world=4, network=net, memory_bytes=int(0.8 * fastest.best.memory.total))
    limited = choose(dims=dims, profile=profile, hardware=tight, global_batch=GLOBAL_BATCH)
    assert limited.best.memory.total <= tight.memory_bytes
    rejected = next(e for e in limited.estimates if e.plan == fastest.plan)
    assert not rejected.fits and rejected.time_s <= limited.best.time_s
    assert "out of memory" in limited.table(limit=None)
    with pytest.raises(ValueError, match="no plan fits"):
        choose(dims=dims, profile=profile, global_batch=GLOBAL_BATCH,
               hardware=Hardware(world=4, network=free.network, memory_bytes=1000))  # fmt: skip


def test_no_schedule_beats_the_shared_cores(profile: ComputeProfile) -> None:
    """4 ranks on 2 cores: a zero-bubble pipeline fills its bubbles with work the idle
    ranks' cores would have run anyway, so it is no faster than the cores allow."""
    model = gpt()
    dims = adapter_for(model).dims(model)
    # a fixed profile (blocks 90% of the time, no per-send overhead) so that the bound binds
    fixed = ComputeProfile(sample_s=0.01, block_share=0.9, acts=profile.acts, op_overhead_s=0.0)
    free = AlphaBeta(alpha=0.0, beta=0.0)
    kw = {"dims": dims, "profile": fixed, "global_batch": GLOBAL_BATCH}
    zb_plan = Plan(dp=2, pp=2, schedule=Schedule.ZERO_BUBBLE, microbatches=2)
    gpipe_plan = Plan(dp=2, pp=2, schedule=Schedule.GPIPE, microbatches=2)
    shared = Hardware(world=4, network=free, slots=2)
    zb = estimate(zb_plan, hardware=shared, **kw)
    gpipe = estimate(gpipe_plan, hardware=shared, **kw)
    cores_bound = GLOBAL_BATCH * fixed.sample_s / 2
    assert zb.compute_s == pytest.approx(cores_bound) and zb.compute_s < gpipe.compute_s
    # with a core per rank the filled bubbles do pay
    own = Hardware(world=4, network=free, slots=4)
    zb_own = estimate(zb_plan, hardware=own, **kw)
    assert zb_own.compute_s < estimate(gpipe_plan, hardware=own, **kw).compute_s
    assert zb_own.compute_s < zb.compute_s


def test_plait_plan_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--workload", "mlp", "--nodes", "2", "--memory", "1GiB",
                     "--bandwidth", "slow"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "**chosen**" in out and "predicted" in out
    with pytest.raises(SystemExit):  # bad input is a usage error, not a traceback
        cli_main(["plan", "--workload", "mlp", "--memory", "lots"])


def test_scorecard_compares_the_choice_with_the_fastest_fitting_plan() -> None:
    def rec(spec: str, desc: str, times: list[float], bw: str = "slow") -> dict[str, object]:
        return {"workload": "gpt", "bandwidth": bw, "strategy_spec": spec,
                "strategy_desc": desc, "iter_time_s": sorted(times)[len(times) // 2],
                "iter_times_s": times}  # fmt: skip

    pp4 = "plan:dp=1,pp=4,microbatches=8"
    records = [
        rec("plan:dp=4", "plan:dp=4", [1.0]),
        rec("plan:pp=4", pp4, [2.0]),
        rec("plan:dp=2,pp=2", "plan:dp=2,pp=2,microbatches=4", [2.1]),
        rec("plan:auto=true", pp4, [2.1]),
        rec("plan:auto=true,memory=100MiB", pp4, [2.1]),
        # a noisy run of the fastest plan is still the fastest plan
        rec("plan:pp=4", pp4, [1.0], bw="fast"),
        rec("plan:dp=4", "plan:dp=4", [1.05], bw="fast"),
        rec("plan:auto=true", pp4, [1.3, 1.4, 1.5], bw="fast"),
        # not the fastest: its pooled median decides
        rec("plan:auto=true,memory=100MiB", "plan:dp=2,pp=2,microbatches=4", [2.2], bw="slow"),
    ]
    peaks = {"dp=4": 200 * 2**20, "dp=1,pp=4,microbatches=8": 80 * 2**20,
             "dp=2,pp=2,microbatches=4": 90 * 2**20}  # fmt: skip
    free, tight, other, noisy = score(records, peaks)
    assert (free["fastest_fitting"], free["within_tolerance"]) == ("dp=4", False)
    assert (tight["fastest_fitting"], tight["within_tolerance"]) == (pp4[5:], True)
    assert tight["fits_measured"] is True
    # the explicit run (2.1) and the automatic one (2.2) pool to 2.15: 1.075x of 2.0
    assert (other["is_fastest"], other["within_tolerance"]) == (False, True)
    assert other["ratio"] == pytest.approx(2.15 / 2.0)
    assert (noisy["is_fastest"], noisy["within_tolerance"]) == (True, True)
    assert "3 of 4 settings" in markdown([free, tight, other, noisy])
