"""The spawned-process test harness: per-rank results, and failures that name the rank."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.testing import WorkerError, run_distributed


def _sum_of_ranks(rank: int, world: int, scale: float) -> tuple[int, int, float, str]:
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return rank, world, scale * x.item(), os.environ["OMP_NUM_THREADS"]


def _environment_at_start(rank: int, world: int) -> list[str]:
    """The variables this process was started with (not those set since)."""
    with open("/proc/self/environ", "rb") as f:
        start = f.read().decode().split("\0")
    return sorted(v for v in start if v.startswith(("PLAIT_TESTING_PROBE=", "OMP_NUM_THREADS=")))


def _rank_1_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ArithmeticError("rank one's own failure")
    return rank


def test_results_come_back_in_rank_order() -> None:
    out = run_distributed(_sum_of_ranks, 10.0, world_size=2, timeout_s=60)
    assert out == [(0, 2, 30.0, "1"), (1, 2, 30.0, "1")]


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs Linux /proc")
def test_workers_start_with_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' variables are in their environment from the start, before torch loads
    (unpickling a test's function imports torch before the worker runs a line), and the
    caller's environment is left as it was. Libraries that read OMP_NUM_THREADS when they
    load missed a value set later: gloo's callback threads, where compression hooks
    decompress, then rounded differently on two ranks in 3 of 20 loaded runs of ACP-SGD,
    and its replicas drifted apart (0 of 24 once the variable was inherited)."""
    monkeypatch.delenv("PLAIT_TESTING_PROBE", raising=False)
    out = run_distributed(
        _environment_at_start, world_size=2, timeout_s=60, env={"PLAIT_TESTING_PROBE": "x"}
    )
    assert out == [["OMP_NUM_THREADS=1", "PLAIT_TESTING_PROBE=x"]] * 2
    assert "PLAIT_TESTING_PROBE" not in os.environ


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="needs Linux /proc")
def test_jobs_started_from_threads_get_their_own_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Jobs started at once from threads (as the crossover tests do) each start with their
    own variables, and the caller's environment is left as it was."""
    monkeypatch.delenv("PLAIT_TESTING_PROBE", raising=False)
    out: dict[int, Any] = {}

    def job(i: int) -> None:
        out[i] = run_distributed(
            _environment_at_start, world_size=2, timeout_s=120, env={"PLAIT_TESTING_PROBE": str(i)}
        )

    threads = [threading.Thread(target=job, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert out == {i: [["OMP_NUM_THREADS=1", f"PLAIT_TESTING_PROBE={i}"]] * 2 for i in range(4)}
    assert "PLAIT_TESTING_PROBE" not in os.environ


def test_a_failing_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(WorkerError, match="rank 1 raised") as info:
        run_distributed(_rank_1_fails, world_size=2, timeout_s=60)
    assert "ArithmeticError: rank one's own failure" in str(info.value)
    assert "rank 0 raised" not in str(info.value)


def test_world_size_is_checked_before_spawning() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_distributed(_sum_of_ranks, 1.0, world_size=0)
