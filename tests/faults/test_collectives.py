"""A lost or stopped peer stops every survivor with an error, within the collective timeout.

Each case trains a few good steps on every rank, then one rank dies (``os._exit`` from
inside a step) or stops itself (SIGSTOP). The survivors must raise from their next step,
naming the failed collective and, where the group says which, the lost peer; they must not
train on alone on their local gradients, and they must not wait torch's 30-minute default
on the subgroups plait creates (Power-SGD's, K-FAC's, the parallel mesh's).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
from torch import nn

from plait.testing import Outcome, run_faulty

TIMEOUT_S = 6.0  # the gloo group's timeout in these tests
SLACK_S = 20.0  # two busy cores: imports, group set-up and the good steps before the fault
GOOD_STEPS = 3
STEPS = 40


def _fault(rank: int, world: int, step: int, mode: str) -> None:
    """The last rank fails at step GOOD_STEPS: dies or stops itself."""
    if rank != world - 1 or step != GOOD_STEPS:
        return
    if mode == "kill":
        os._exit(17)
    os.kill(os.getpid(), signal.SIGSTOP)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _ddp(rank: int, world: int, compression: str, mode: str) -> int:
    import plait

    model = plait.data_parallel(_mlp(), compression)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        _fault(rank, world, step, mode)
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(0.02)
    return STEPS


def _kfac(rank: int, world: int, mode: str) -> int:
    """K-FAC alone (no DDP): its factor all-reduces are the only collectives of a step."""
    from plait.kfac import KFAC, KFACConfig

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFAC(model, KFACConfig(inv_interval=2), optimizer=opt)
    for step in range(STEPS):
        _fault(rank, world, step, mode)
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        precond.step()
        opt.step()
        time.sleep(0.02)
    return STEPS


def _plan(rank: int, world: int, plan: str, mode: str) -> int:
    import plait
    from tests.parallel.common import BATCH, batches, gpt, loss_fn

    model, opt = plait.parallelize(
        gpt(), torch.optim.AdamW(gpt().parameters()), plan, loss_fn=loss_fn
    )
    xs, ys = batches(STEPS)
    dp = world if "dp=" in plan else 1
    shard = slice(rank * BATCH // dp, (rank + 1) * BATCH // dp) if dp > 1 else slice(None)
    for step in range(STEPS):
        _fault(rank, world, step, mode)
        opt.zero_grad()
        model.step(xs[step][shard], ys[step][shard])
        opt.step()
    return STEPS


def _check(
    outcomes: list[Outcome], *, mode: str, name_peer: bool = True, plait_comm: bool = True
) -> None:
    """Survivors raised in time a `plait.comm.CollectiveError` naming the peer.

    `plait_comm` False: the failing collective is torch's own (DTensor's), whose gloo
    error plait turns into the class (it names the step, and the peer where gloo does).
    """
    world = len(outcomes)
    victim = outcomes[-1]
    assert victim.status == ("died" if mode == "kill" else "hung"), victim
    for o in outcomes[:-1]:
        assert o.status == "raised", f"rank {o.rank} {o.status} instead of raising: {o}"
        # the class itself, so that `except CollectiveError` catches it
        assert o.exception == "plait.comm.ops.CollectiveError", o.error
        if not plait_comm:
            assert "Timed out" in o.message or "Connection" in o.message, o.error
            assert o.elapsed_s is not None and o.elapsed_s < TIMEOUT_S + SLACK_S, o.elapsed_s
            continue
        assert f"rank {o.rank} in the group" in o.message, o.message
        if name_peer:
            assert f"peer rank {world - 1}" in o.message, o.message
        assert o.elapsed_s is not None and o.elapsed_s < TIMEOUT_S + SLACK_S, o.elapsed_s
    if mode == "stop" and plait_comm:  # it waited out the timeout, not failed at once
        assert all("did not answer" in o.message for o in outcomes[:-1]), outcomes


COMPRESSORS = ["ssgd", "fp16", "signsgd", "topk", "powersgd", "torch-powersgd", "acpsgd"]


@pytest.mark.parametrize("compression", COMPRESSORS)
def test_killed_peer_stops_data_parallel(compression: str) -> None:
    _check(run_faulty(_ddp, compression, "kill", collective_timeout_s=TIMEOUT_S), mode="kill")


@pytest.mark.parametrize("compression", ["ssgd", "powersgd"])  # powersgd: its own subgroup
def test_stopped_peer_stops_data_parallel(compression: str) -> None:
    _check(run_faulty(_ddp, compression, "stop", collective_timeout_s=TIMEOUT_S), mode="stop")


def test_killed_peer_stops_three_ranks() -> None:
    outcomes = run_faulty(_ddp, "acpsgd", "kill", world_size=3, collective_timeout_s=TIMEOUT_S)
    _check(outcomes, mode="kill", name_peer=False)


@pytest.mark.parametrize("mode", ["kill", "stop"])  # stop: K-FAC's subgroup's timeout
def test_lost_peer_stops_kfac_factor_communication(mode: str) -> None:
    outcomes = run_faulty(_kfac, mode, collective_timeout_s=TIMEOUT_S)
    _check(outcomes, mode=mode)
    assert all("factors" in o.message or "inverse" in o.message for o in outcomes[:-1]), [
        o.message for o in outcomes
    ]


@pytest.mark.parametrize(("plan", "mode"), [("dp=2,zero=1", "kill"), ("tp=2", "stop")])
def test_lost_peer_stops_parallel_plan(plan: str, mode: str) -> None:
    """dp: plait's gradient sync raises; tp: DTensor's collectives on the mesh's tp group,
    which must time out after plait's timeout, not torch's 30 minutes."""
    outcomes = run_faulty(_plan, plan, mode, collective_timeout_s=TIMEOUT_S)
    _check(outcomes, mode=mode, name_peer=False, plait_comm="tp" not in plan)


def _subgroup_timeout(rank: int, world: int) -> Any:
    import torch.distributed as dist

    from plait.distributed import collective_timeout, new_group

    group = new_group()
    if rank == 1:
        time.sleep(10.0)  # never joins (longer than the 4 s timeout)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2), group=group)
    except RuntimeError as exc:
        return time.monotonic() - start, str(exc), collective_timeout(group).total_seconds()
    return None


def test_subgroups_carry_the_collective_timeout() -> None:
    outcomes = run_faulty(_subgroup_timeout, collective_timeout_s=4.0, grace_s=60.0)
    waited, message, timeout = outcomes[0].value
    assert timeout == 4.0
    assert 3.0 < waited < 4.0 + SLACK_S, (waited, message)
