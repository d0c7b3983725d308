from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from plait.bench.harness import BenchSpec, bench_record, run_benchmark
from plait.bench.records import BenchRecord
from plait.testing import run_distributed
from plait.train.strategy import Strategy

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


class _Local(Strategy):
    """A strategy that trains the model as it is: no process group needed."""

    name = "local"

    def __init__(self, spec: str) -> None:
        super().__init__()
        self.spec = spec

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def describe(self) -> str:
        return f"local {self.spec}"


def _workload() -> Any:
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    data = SimpleNamespace(train=list(zip(x, y, strict=True)), info=None)
    return SimpleNamespace(
        bench_batch=2,
        bench_data=lambda n: data,
        model=lambda info, bench: nn.Linear(4, 2),
        loss=nn.functional.cross_entropy,
    )


def test_rounds_interleave_strategies_then_compute_only_and_summarise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Synthetic timings through the whole harness loop, without a process group: the
    turns run A B, A-compute B-compute per round, warm-up rounds are dropped and each
    figure is the median (min, max) of what the kept turns measured."""
    from plait.bench import harness

    turns: list[tuple[str, str]] = []
    real_step = harness._step

    def step(r: Any, x: torch.Tensor, y: torch.Tensor, loss: Any, phase: str = "step") -> None:
        turns.append((r.spec, phase))
        real_step(r, x, y, loss, phase)

    class Clock:
        """Turn k (from 1) lasts k seconds of wall time and k / 10 of CPU."""

        def __enter__(self) -> Clock:
            return self

        def __exit__(self, *exc: object) -> None:
            self.wall_s, self.cpu_s = float(len(turns)), len(turns) / 10

    monkeypatch.setattr(harness, "get_workload", lambda name: _workload())
    monkeypatch.setattr(harness, "make_strategy", _Local)
    monkeypatch.setattr(harness, "_step", step)
    monkeypatch.setattr(harness, "Stopwatch", Clock)
    spec = BenchSpec(workload="fake", strategies=["a", "b:x=1"], steps=3, warmup=1, probe=False)
    a, b = harness.run_benchmark(spec)
    assert turns[:4] == [
        ("a", "step"),
        ("b:x=1", "step"),
        ("a", "compute-only"),
        ("b:x=1", "compute-only"),
    ]
    assert len(turns) == 4 * (1 + 3)
    # kept rounds 1..3: a's steps are turns 5, 9, 13; its compute-only steps 7, 11, 15
    assert a.iter_times_s == [5.0, 9.0, 13.0] and b.iter_times_s == [6.0, 10.0, 14.0]
    assert a.compute_times_s == [7.0, 11.0, 15.0]
    assert (a.iter_time_s, a.iter_time_min_s, a.iter_time_max_s) == (9.0, 5.0, 13.0)
    assert a.compute_time_s == 11.0 and a.overlap_efficiency == pytest.approx(11 / 9)
    assert a.cpu_time_s == pytest.approx(0.9) and a.compute_cpu_time_s == pytest.approx(1.1)
    assert (a.strategy, b.strategy, b.strategy_spec) == ("a", "b", "b:x=1")
    assert a.samples_per_s == pytest.approx(2 / 9) and a.steps == 3 and a.warmup == 1
    assert a.probe is None and "probe" not in a.to_dict()
    assert a.nic_bytes_per_step is None and a.bytes_per_step == 0.0


def test_bench_record_from_synthetic_figures() -> None:
    rec = bench_record(
        workload="mlp",
        strategy_spec="acpsgd:rank=4",
        strategy_desc="acpsgd rank 4",
        world=4,
        bandwidth="slow",
        rate="100mbit",
        batch=8,
        params=1000,
        warmup=2,
        iter_s=[0.5, 0.3, 0.4, 0.9],
        compute_s=[0.2, 0.25, 0.2, 0.3],
        cpu_s=[0.4, 0.5, 0.6, 0.5],
        compute_cpu_s=[0.3, 0.3, 0.3, 0.3],
        payload=[100, 100, 300, 100],
        wire=[150.0, 150.0, 450.0, 150.0],
        comm_lb=[0.35, 0.4, 0.38, 0.36],
        nic=[400.0, 400.0, 800.0, 400.0],
        threads=1,
    )
    assert rec.strategy == "acpsgd" and rec.nodes == 4 and rec.steps == 4
    assert rec.iter_time_s == pytest.approx(0.45) and rec.iter_time_mean_s == pytest.approx(0.525)
    assert (rec.iter_time_min_s, rec.iter_time_max_s) == (0.3, 0.9)
    assert rec.compute_time_s == pytest.approx(0.225)
    assert rec.comm_lower_bound_s == pytest.approx(0.37)
    assert rec.overlap_efficiency == pytest.approx(0.37 / 0.45)  # the bound exceeds compute
    assert rec.cpu_time_s == pytest.approx(0.5) and rec.compute_cpu_time_s == pytest.approx(0.3)
    assert rec.payload_bytes_per_step == 100 and rec.bytes_per_step == 150.0
    assert rec.nic_bytes_per_step == 400.0  # one process per node
    assert rec.samples_per_s == pytest.approx(4 * 8 / 0.45)
    assert set(rec.to_dict()) >= CONTRACT
