"""examples/fused_sweep.py runs: a user's model and search space swept as fused arrays."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fused_sweep.py"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        check=False,
    )


def test_the_example_sweeps_its_own_model(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    done = run("--trials", "3", "--epochs", "1", "--max-models", "2", "--storage", storage)
    assert done.returncode == 0, done.stderr
    assert "3 trials (3 complete)" in done.stdout and "best: trial #" in done.stdout
    name = "fused-sweep-example-adam"  # the example keeps one study per optimizer (Adam by default)
    study = optuna.load_study(study_name=name, storage=storage)
    assert len(study.trials) == 3
    assert {"lr", "beta1", "dropout", "channels"} <= set(study.trials[0].params)
    # Under torchrun / plait run, ranks other than 0 leave the sweep to rank 0.
    other = run("--trials", "5", "--storage", storage, env={"RANK": "1"})
    assert other.returncode == 0 and other.stdout == ""
    assert len(optuna.load_study(study_name=name, storage=storage).trials) == 3
