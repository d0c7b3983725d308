"""The spawned-process test harness: per-rank results, and failures that name the rank."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from plait.testing import WorkerError, run_distributed


def _sum_of_ranks(rank: int, world: int, scale: float) -> tuple[int, int, float, str]:
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return rank, world, scale * x.item(), os.environ["OMP_NUM_THREADS"]


def _rank_1_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ArithmeticError("rank one's own failure")
    return rank


def test_results_come_back_in_rank_order() -> None:
    out = run_distributed(_sum_of_ranks, 10.0, world_size=2, timeout_s=60)
    assert out == [(0, 2, 30.0, "1"), (1, 2, 30.0, "1")]


def test_a_failing_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(WorkerError, match="rank 1 raised") as info:
        run_distributed(_rank_1_fails, world_size=2, timeout_s=60)
    assert "ArithmeticError: rank one's own failure" in str(info.value)
    assert "rank 0 raised" not in str(info.value)


def test_world_size_is_checked_before_spawning() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_distributed(_sum_of_ranks, 1.0, world_size=0)
