"""Process-group set-up: a world of one without a launcher, and plait's timeout on every
group it creates."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from plait import distributed as pdist
from plait.testing import run_distributed


def test_world_of_one_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # one of the two is not enough
    assert pdist.init_distributed() == 1
    assert not dist.is_initialized()
    assert (pdist.rank(), pdist.world_size(), pdist.is_main()) == (0, 1, True)
    assert pdist.device() == torch.device("cpu")
    pdist.barrier()  # nothing to wait for
    pdist.shutdown()


def test_collective_timeout_falls_back_to_plait_timeout() -> None:
    assert not dist.is_initialized()
    fallback = datetime.timedelta(seconds=pdist.DEFAULT_TIMEOUT_S)
    assert pdist.collective_timeout() == fallback
    opts = pdist.mesh_backend_options(2)
    assert sorted(opts) == [0, 1]
    assert all(o._timeout == fallback for o in opts.values())


#: the harness's group timeout: unlike torch's 30-minute default for subgroups
_TIMEOUT_S = 45.0


def _groups(rank: int, world: int) -> dict[str, float]:
    solo = pdist.new_group([rank], use_local_synchronization=True)
    pair = pdist.new_group()
    explicit = pdist.new_group(timeout=datetime.timedelta(seconds=7))
    x = torch.ones(1)
    dist.all_reduce(x, group=pair)
    return {
        "init": pdist.init_distributed(),  # already initialised: the world size
        "default": pdist.collective_timeout().total_seconds(),
        "solo": pdist.collective_timeout(solo).total_seconds(),
        "pair": pdist.collective_timeout(pair).total_seconds(),
        "explicit": pdist.collective_timeout(explicit).total_seconds(),
        "sum": x.item(),
        "mesh": pdist.mesh_backend_options(1)[0]._timeout.total_seconds(),
    }


def test_new_groups_carry_the_default_groups_timeout() -> None:
    for out in run_distributed(_groups, world_size=2, timeout_s=_TIMEOUT_S):
        assert out["init"] == 2 and out["sum"] == 2.0
        assert out["default"] == out["solo"] == out["pair"] == out["mesh"] == _TIMEOUT_S
        assert out["explicit"] == 7.0  # a timeout given by the caller wins
