"""Process-group set-up: a world of one without a launcher, and plait's timeout on every
group it creates."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from plait import comm
from plait import distributed as pdist
from plait.testing import run_distributed


def test_world_of_one_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # one of the two is not enough
    assert pdist.init_distributed() == 1
    assert not dist.is_initialized()
    assert (pdist.rank(), pdist.world_size(), pdist.is_main()) == (0, 1, True)
    assert pdist.device() == torch.device("cpu")
    comm.barrier()  # nothing to wait for
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


@pytest.mark.parametrize(
    ("ranks", "gpus", "index", "backend", "device", "shared"),
    [
        (4, 0, 2, "gloo", "cpu", False),  # the CPU: gloo, whatever the host has
        (4, 1, 3, "gloo", "cuda:0", True),  # four emulated nodes on one GPU
        (4, 2, 3, "gloo", "cuda:1", True),  # round-robin over the GPUs
        (2, 2, 1, "cpu:gloo,cuda:nccl", "cuda:1", False),  # a GPU each: NCCL
    ],
)
def test_gpu_placement_shares_gpus_through_gloo_and_gives_nccl_a_gpu_each(
    ranks: int, gpus: int, index: int, backend: str, device: str, shared: bool
) -> None:
    kind = "cpu" if gpus == 0 else "cuda"
    place = pdist.gpu_placement(kind, host_ranks=ranks, host_index=index, gpus=gpus)
    assert (place.backend, place.device, place.shared) == (backend, device, shared)
    assert place.nccl == ("nccl" in backend)


def test_gpu_placement_refuses_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        pdist.gpu_placement("cuda", host_ranks=2, host_index=0, gpus=0)
    with pytest.raises(ValueError, match="cpu or cuda"):
        pdist.gpu_placement("tpu", host_ranks=1, host_index=0, gpus=0)
    with pytest.raises(ValueError, match="not a rank"):
        pdist.gpu_placement("cpu", host_ranks=2, host_index=2, gpus=0)


def test_host_ranks_count_every_emulated_node_of_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("PLAIT_NODES", raising=False)
    assert pdist.host_ranks() == (2, 1)  # torchrun alone: its node is the host
    monkeypatch.setenv("PLAIT_NODES", "4")
    monkeypatch.setenv("PLAIT_NODE", "3")
    assert pdist.host_ranks() == (8, 7)  # emulated nodes share the host


def test_device_kind_reads_plait_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pdist.DEVICE_ENV, "cpu")
    assert pdist.device_kind() == "cpu"
    monkeypatch.setenv(pdist.DEVICE_ENV, "xpu")
    with pytest.raises(ValueError, match="expected cpu or cuda"):
        pdist.device_kind()
    if not torch.cuda.is_available():
        monkeypatch.setenv(pdist.DEVICE_ENV, "cuda")
        with pytest.raises(ValueError, match="sees no CUDA device"):
            pdist.device_kind()
