from __future__ import annotations

import pytest
import torch

from plait.comm import Collective, all_gather, all_reduce, broadcast, reduce_scatter, stats
from plait.testing import run_distributed


def _collectives(rank: int, world: int) -> dict[str, object]:
    stats.reset()
    a = torch.arange(8, dtype=torch.float32) + rank
    all_reduce(a).wait()
    g = all_gather(torch.tensor([rank, rank * 10])).wait()
    b = torch.full((3,), float(rank))
    broadcast(b, src=world - 1).wait()
    rs = reduce_scatter(torch.arange(4 * world, dtype=torch.float32)).wait()
    recs = stats.reset()
    return {"a": a, "g": g, "b": b, "rs": rs, "ops": [(r.op, r.nbytes, r.world) for r in recs]}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives_are_correct_and_counted(world: int) -> None:
    for rank, res in enumerate(run_distributed(_collectives, world_size=world)):
        base = torch.arange(8, dtype=torch.float32)
        assert torch.equal(res["a"], base * world + sum(range(world)))
        assert res["g"].tolist() == [[r, r * 10] for r in range(world)]
        assert res["b"].tolist() == [float(world - 1)] * 3
        full = torch.arange(4 * world, dtype=torch.float32) * world
        expect_rs = full if world == 1 else full[rank * 4 : (rank + 1) * 4]
        assert torch.equal(res["rs"], expect_rs)
        if world == 1:
            assert res["ops"] == []  # nothing leaves a world of one
        else:
            assert res["ops"] == [
                (Collective.ALL_REDUCE, 32, world),
                (Collective.ALL_GATHER, 16, world),
                (Collective.BROADCAST, 12, world),
                (Collective.REDUCE_SCATTER, 16 * world, world),
            ]


def _describe(rank: int, world: int) -> tuple[str, int | None, str]:
    from plait.comm import CollectiveError, wait
    from plait.comm.ops import collective_error

    err = collective_error(
        Collective.ALL_REDUCE, "allreduce b0", None,
        RuntimeError("Read error [127.0.0.1]:4242: Connection reset by peer"),
    )  # fmt: skip
    src: torch.futures.Future[None] = torch.futures.Future()

    def fail(_: torch.futures.Future[None]) -> None:
        raise err

    chained = src.then(fail)
    src.set_result(None)
    try:
        wait(chained)
    except CollectiveError as typed:  # wait() turns torch's text back into the type
        return str(err), err.peer, str(typed)
    return str(err), err.peer, ""


def test_collective_error_names_the_group_and_the_lost_peer() -> None:
    for rank, (message, peer, typed) in enumerate(run_distributed(_describe, world_size=2)):
        assert peer == 1 - rank
        assert f"failed on rank {rank} in the group of ranks [0, 1] (size 2)" in message
        assert f"peer rank {1 - rank} ([127.0.0.1]:4242) lost" in message
        assert typed == message


def test_collective_errors_turns_transport_failures_into_the_class() -> None:
    from plait.comm.ops import CollectiveError, collective_error, collective_errors

    gloo = (
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[10.200.1.2]:4021"
    )
    with pytest.raises(CollectiveError, match=r"'step'.*lost") as info, collective_errors("step"):
        raise RuntimeError(gloo)
    assert isinstance(info.value.__cause__, RuntimeError)
    # DDP hands a failed hook back as text: the error comes back with its attributes
    original = collective_error(Collective.ALL_REDUCE, "allreduce b0", None, RuntimeError(gloo))
    wrapped = RuntimeError(f"Got the following error: CollectiveError: {original}\n\nAt: x")
    with pytest.raises(CollectiveError) as again, collective_errors("step"):
        raise wrapped
    assert again.value.collective == "allreduce b0" and str(again.value) == str(original)
    # anything else passes through untouched
    with pytest.raises(RuntimeError, match="shape mismatch"), collective_errors("step"):
        raise RuntimeError("shape mismatch")
    with pytest.raises(ValueError), collective_errors("step"):
        raise ValueError("gloo")


def _retained_after_destroy(rank: int, world: int) -> tuple[bool, bool]:
    import gc

    import torch.distributed as dist

    import plait
    from plait import distributed as pdist

    model = plait.data_parallel(torch.nn.Linear(4, 2), "acpsgd:rank=1")
    group = model.process_group
    model(torch.randn(3, 4)).sum().backward()
    dist.destroy_process_group()
    del model
    gc.collect()
    # the reducer was not the group's last owner: its destructor joined no gloo thread
    return any(g is group for g in pdist._RETAINED.values()), len(pdist._RETAINED) >= 1


def test_data_parallel_groups_outlive_their_wrapper() -> None:
    """The DDP tutorial's order (destroy the group, then drop the model) hung at exit when
    the reducer held a gloo group's last reference (see `plait.distributed.retain_group`)."""
    assert run_distributed(_retained_after_destroy, world_size=2) == [(True, True)] * 2
