"""Steps-to-target bookkeeping of the convergence comparison."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from plait.bench import convergence
from plait.bench.convergence import _parse_runs, markdown, steps_to, summarise
from plait.bench.records import ConvergenceReport, ConvergenceRun, ConvergenceSummary


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


def test_main_writes_the_report_through_the_one_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With training faked (a curve per run whose speed depends on lr), the report holds
    every run, the summary and its provenance, and loads back as a `ConvergenceReport`."""

    def fake_run(run: convergence.Run, **_: Any) -> list[dict[str, Any]]:
        rate = 0.01 if run.lr < 0.05 else 0.02
        return [
            {"step": s, "train_loss": 1.0, "test_loss": 1.0, "test_accuracy": min(1.0, rate * s)}
            for s in range(5, 105, 5)
        ]

    monkeypatch.setattr(convergence, "run_one", fake_run)
    monkeypatch.setattr(convergence, "_init_single_process_group", lambda: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    argv = ["--workload", "mlp", "--run", "ssgd@0.01,0.1", "--seeds", "0,1", "--out", str(tmp_path)]
    assert convergence.main([*argv, "--target", "0.9"]) == 0
    report = ConvergenceReport.from_dict(json.loads((tmp_path / "results.json").read_text()))
    assert len(report.runs) == 4
    assert report.meta.workload == "mlp" and report.meta.commit
    assert (report.summary.best["ssgd"].lr, report.summary.best["ssgd"].median) == (0.1, 45)
    assert (tmp_path / "results.md").read_text().startswith("# Convergence\n\nCommand: `")
    assert (tmp_path / "results.png").stat().st_size > 0
