"""The fused suite's rounds and records, on synthetic timings (no model trains)."""

from __future__ import annotations

from typing import Any

import pytest

from plait.bench.fused import ArrayStrategy, BenchConfig, runner
from plait.bench.fused.strategies import Runner


def test_rounds_rotate_and_records_take_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    turns: list[str] = []

    class Fake(Runner):
        """Fused steps take 1, 3, 2 s per round (per 2 steps), serial twice as long."""

        def __init__(self, strategy: ArrayStrategy) -> None:
            self.strategy, self.calls = strategy, 0

        def run(self, steps: int) -> tuple[float, float]:
            self.calls += 1
            if self.calls == 1:  # warm-up, right after the build
                assert steps == 5
                return 99.0, 99.0
            turns.append(self.strategy.value)
            wall = [1.0, 3.0, 2.0][self.calls - 2] * steps
            factor = 2.0 if self.strategy is ArrayStrategy.SERIAL else 1.0
            return factor * wall, factor * wall / 2

    def make(strategy: ArrayStrategy, *args: Any, **kwargs: Any) -> Runner:
        return Fake(strategy)

    monkeypatch.setattr(runner, "make_runner", make)
    cfg = BenchConfig(
        models=("mlp",),
        sizes=(4,),
        strategies=(ArrayStrategy.FUSED, ArrayStrategy.SERIAL),
        steps=2,
        rounds=3,
        warmup=5,
        batch_size=8,
    )
    fused, serial = runner.run_bench_fused(cfg)
    assert turns == ["fused", "serial", "serial", "fused", "fused", "serial"]
    assert (fused.iter_time_s, fused.iter_time_min_s, fused.iter_time_max_s) == (2.0, 1.0, 3.0)
    assert fused.cpu_time_s == 1.0 and serial.iter_time_s == 4.0
    assert fused.throughput == pytest.approx(4 * 8 / 2.0)
    assert fused.speedup_vs_serial == pytest.approx(2.0) == fused.speedup_vs_fastest_serial
    assert fused.fastest_threads and serial.fastest_threads and fused.bandwidth == "n4"
