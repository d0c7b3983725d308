from __future__ import annotations

import pytest

from plait.bench.harness import BenchSpec, run_benchmark
from plait.bench.records import BenchRecord
from plait.testing import run_distributed

CONTRACT = {
    "workload",
    "strategy",
    "nodes",
    "nproc_per_node",
    "bandwidth",
    "rate",
    "batch_size",
    "iter_time_s",
    "iter_time_min_s",
    "iter_time_max_s",
    "compute_time_s",
    "bytes_per_step",
    "overlap_efficiency",
}


def _bench(rank: int, world: int, spec: BenchSpec) -> list[BenchRecord]:
    return run_benchmark(spec)


def test_records_side_by_side() -> None:
    spec = BenchSpec(
        workload="mlp", strategies=["ssgd", "ssgd:bucket_cap_mb=1"], steps=3, warmup=1, batch_size=8
    )
    recs = run_distributed(_bench, spec, world_size=2, timeout_s=300)
    assert recs[0] == recs[1]  # every rank reports the same (slowest-rank) figures
    a, b = recs[0]
    for r in (a, b):
        assert set(r.to_dict()) >= CONTRACT
        assert r.iter_time_min_s <= r.iter_time_s <= r.iter_time_max_s
        assert len(r.iter_times_s) == 3 and r.compute_time_s > 0
        assert 0 < r.overlap_efficiency < 2
        # a step costs its process CPU time; a one-thread worker cannot use more than
        # its wall time plus the collective library's threads, a few times over at most
        assert r.compute_cpu_time_s is not None and r.compute_cpu_time_s > 0
        assert r.cpu_time_s is not None and 0 < r.cpu_time_s < 8 * r.iter_time_max_s
        assert r.probe is not None and r.probe["world"] == 2
    # same model, same bytes whatever the bucketing; 1 MiB buckets mean more collectives
    assert a.bytes_per_step == b.bytes_per_step == pytest.approx(2 * (2 - 1) / 2 * 4 * a.params)
    assert a.strategy == b.strategy == "ssgd"
    assert b.strategy_spec == "ssgd:bucket_cap_mb=1"


def test_bad_spec() -> None:
    with pytest.raises(ValueError, match="workload"):
        BenchSpec(workload="alexnet", strategies=["ssgd"])
    with pytest.raises(ValueError, match="no strategies"):
        BenchSpec(workload="mlp", strategies=[])
