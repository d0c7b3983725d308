"""The co-location report: its table and the files it writes."""

from __future__ import annotations

import json
from pathlib import Path

from plait.bench.crossover_report import markdown, write
from plait.bench.records import Comparison, ModeResult


def _mode(speedup: float, busy: float | None) -> ModeResult:
    return ModeResult(
        steps_per_s=[1.0, 1.0],
        normalised=[0.75, 0.75],
        speedup_vs_sequential=speedup,
        speedup_runs=[speedup],
        slowdown_vs_alone=[1.5, 1.5],
        window_s=10.0,
        token=[None, None],
        fairness=1.0,
        cpu_busy=busy,
    )


def _comparison() -> Comparison:
    return Comparison(
        jobs=["job0:a/ssgd", "job1:b/ssgd"],
        bandwidth="balanced",
        rate="1gbit",
        steps=10,
        warmup=1,
        repeats=1,
        alone_steps_per_s=[1.0, 1.0],
        alone_step_s=[1.0, 1.0],
        compute_s=[0.5, 0.5],
        alone_cpu_busy=[0.61, None],
        modes={"uncoordinated": _mode(1.2, 0.874), "crossover": _mode(1.5, 0.9)},
    )


def test_table_gives_the_cpu_busy_share_of_each_window() -> None:
    table = markdown([_comparison()]).splitlines()
    assert table[2].endswith("| 61%, - / 87% / 90% |")
    assert table[2].count("|") == table[0].count("|")
    assert "| 1.20 | 1.50 | 1.25 | 2.00 |" in table[2]  # x seq, x uncoordinated, ideal
    assert markdown([_comparison().to_dict()]) == markdown([_comparison()])


def test_written_records_carry_commit_command_machine(tmp_path: Path) -> None:
    paths = write([_comparison()], tmp_path, command="plait crossover run a b --compare")
    (saved,) = json.loads(paths["json"].read_text())
    assert list(saved)[-4:] == ["ideal_speedup", "commit", "command", "machine"]
    assert "torch" not in saved and saved["modes"]["crossover"]["cpu_busy"] == 0.9
    assert Comparison.from_dict(saved).modes == _comparison().modes
    assert paths["markdown"].read_text().startswith("# Crossover results\n\nCommand: `plait")
    assert paths["png"].stat().st_size > 1000
