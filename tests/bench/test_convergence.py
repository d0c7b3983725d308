"""Steps-to-target bookkeeping of the convergence comparison."""

from __future__ import annotations

import pytest

from plait.bench.convergence import _parse_runs, markdown, steps_to, summarise
from plait.bench.records import ConvergenceRun, ConvergenceSummary


def test_steps_to_is_the_first_evaluation_at_target() -> None:
    curve = [{"step": s, "test_accuracy": a} for s, a in [(5, 0.5), (10, 0.96), (15, 0.9)]]
    assert steps_to(curve, 0.95) == 10
    assert steps_to(curve, 0.99) is None


def test_summary_picks_the_best_learning_rate_and_skips_misses() -> None:
    def run(strategy: str, lr: float, seed: int, hit: int | None) -> ConvergenceRun:
        return ConvergenceRun(strategy=strategy, lr=lr, seed=seed, steps_to_target=hit, curve=[])

    records = [
        run("ssgd", 0.1, 0, 100),
        run("ssgd", 0.1, 1, 140),
        run("ssgd", 0.5, 0, 20),
        run("ssgd", 0.5, 1, None),  # one seed missed
        run("spd-kfac:damping=0.01", 0.01, 0, 60),
        run("spd-kfac:damping=0.01", 0.01, 1, 60),
    ]
    summary = summarise(records, 0.95)
    assert summary.best["ssgd"].lr == 0.1
    assert summary.best["ssgd"].median == 120
    assert summary.best["spd-kfac"].median == 60
    assert summary.settings[1].median is None
    assert "| ssgd | 0.5 | 20, - | not reached |" in markdown(summary, baseline="ssgd")
    assert ConvergenceSummary.from_dict(summary.to_dict()) == summary
    assert "| spd-kfac:damping=0.01 | 0.01 | 60 | 0.50x |" in markdown(summary, baseline="ssgd")


def test_run_specs_need_a_learning_rate() -> None:
    runs = _parse_runs(["spd-kfac:inv_interval=10@0.01,0.1"], [0, 1])
    assert [(r.family, r.lr, r.seed) for r in runs][:3] == [
        ("spd-kfac", 0.01, 0),
        ("spd-kfac", 0.01, 1),
        ("spd-kfac", 0.1, 0),
    ]
    with pytest.raises(ValueError, match="STRATEGY@LR"):
        _parse_runs(["ssgd"], [0])
