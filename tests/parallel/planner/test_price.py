"""Pricing: memory and network decide the choice, the cores bound the schedules, the
choice explains itself."""

from __future__ import annotations

from typing import Any

import pytest

from plait.comm import AlphaBeta
from plait.parallel import Plan, Schedule, adapter_for
from plait.parallel.memory import ActivationProfile
from plait.parallel.planner import ComputeProfile, Hardware, choose, estimate, pipeline_time
from tests.parallel.common import gpt

GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def profile() -> ComputeProfile:
    """A fixed profile: pricing is arithmetic and needs no measurement."""
    acts = ActivationProfile(block=64e3, other=32e3, block_input=4e3)
    return ComputeProfile(sample_s=0.01, block_share=0.8, acts=acts, tp_overhead_s=(1e-4, 2e-4))


def test_choice_respects_memory_and_network(profile: ComputeProfile) -> None:
    model = gpt()
    dims = adapter_for(model).dims(model)
    free = Hardware(world=4, network=AlphaBeta(alpha=0.0, beta=0.0))
    # a free network and a device per rank: data parallelism has nothing to lose
    best = choose(dims=dims, profile=profile, hardware=free, global_batch=GLOBAL_BATCH)
    assert (best.plan.dp, best.plan.ac) == (4, False)
    # a tight memory: the choice fits, the faster plans are rejected as out of memory
    net = AlphaBeta.from_rate(1e9)
    fastest = choose(
        dims=dims,
        profile=profile,
        global_batch=GLOBAL_BATCH,
        hardware=Hardware(world=4, network=net),
    )
    tight = Hardware(world=4, network=net, memory_bytes=int(0.8 * fastest.best.memory.total))
    limited = choose(dims=dims, profile=profile, hardware=tight, global_batch=GLOBAL_BATCH)
    assert tight.memory_bytes is not None
    assert limited.best.memory.total <= tight.memory_bytes
    rejected = next(e for e in limited.estimates if e.plan == fastest.plan)
    assert not rejected.fits and rejected.time_s <= limited.best.time_s
    assert "out of memory" in limited.table(limit=None)
    with pytest.raises(ValueError, match="no plan fits"):
        choose(
            dims=dims,
            profile=profile,
            global_batch=GLOBAL_BATCH,
            hardware=Hardware(world=4, network=free.network, memory_bytes=1000),
        )


def test_no_schedule_beats_the_shared_cores(profile: ComputeProfile) -> None:
    """4 ranks on 2 cores: a zero-bubble pipeline fills its bubbles with work the idle
    ranks' cores would have run anyway, so it is no faster than the cores allow."""
    model = gpt()
    dims = adapter_for(model).dims(model)
    # a fixed profile (blocks 90% of the time, no per-send overhead) so that the bound binds
    fixed = ComputeProfile(sample_s=0.01, block_share=0.9, acts=profile.acts, op_overhead_s=0.0)
    free = AlphaBeta(alpha=0.0, beta=0.0)
    kw: dict[str, Any] = {"dims": dims, "profile": fixed, "global_batch": GLOBAL_BATCH}
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


def test_pipeline_time_without_contention_is_the_classic_bubble() -> None:
    # 4 chunks through 2 stages, a core per rank: (chunks + pp - 1) ticks of work/chunks
    t = pipeline_time(1.0, pp=2, chunks=4, busy_per_stage=1, slots=2)
    assert t == pytest.approx(5 / 4)
    # one core for both stages: the bubble vanishes, the work runs back to back
    assert pipeline_time(1.0, pp=2, chunks=4, busy_per_stage=1, slots=1) == pytest.approx(2.0)


def test_choice_reason_names_the_plan_and_the_runner_up(profile: ComputeProfile) -> None:
    model = gpt()
    dims = adapter_for(model).dims(model)
    hw = Hardware(world=2, network=AlphaBeta.from_rate(1e8), memory_bytes=None)
    choice = choose(dims=dims, profile=profile, hardware=hw, global_batch=GLOBAL_BATCH)
    assert choice.reason.startswith(f"chose {choice.plan.describe()}: predicted")
    assert "next fitting plan" in choice.reason
    assert choice.to_dict()["reason"] == choice.reason


def test_a_choice_near_its_budget_says_the_model_can_err(profile: ComputeProfile) -> None:
    from plait.parallel.planner.price import MEMORY_MODEL_LOW

    model = gpt()
    dims = adapter_for(model).dims(model)
    free = Hardware(world=2, network=AlphaBeta.from_rate(1e8))
    need = choose(dims=dims, profile=profile, hardware=free, global_batch=GLOBAL_BATCH)
    need_bytes = need.best.memory.total

    def chosen(budget: float) -> Any:
        hw = Hardware(world=2, network=free.network, memory_bytes=int(budget))
        return choose(dims=dims, profile=profile, hardware=hw, global_batch=GLOBAL_BATCH)

    near = chosen(need_bytes * 1.05)  # predicted at 95% of the budget
    assert near.plan == need.plan
    assert "erred low" in near.reason and "14%" in near.reason
    roomy = chosen(need_bytes / MEMORY_MODEL_LOW * 1.01)  # under the model's error band
    assert roomy.plan == need.plan and "erred low" not in roomy.reason
    near.metered = {near.plan.describe(): int(need_bytes)}  # a trial metered it: no caveat
    assert "erred low" not in near.reason
    assert "metered" in near.table()
