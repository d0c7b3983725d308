"""`plait.bench.gpu_suite`: its dry run, the same parts small on the CPU, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from plait.bench import gpu_suite


def test_every_part_has_a_full_and_a_dry_form_within_the_budget() -> None:
    full, dry = gpu_suite.parts(), gpu_suite.parts(dry_run=True)
    assert sum(p.budget_s for p in full) <= gpu_suite.DEFAULT_BUDGET_S
    assert {p.name for p in dry} <= {p.name for p in full}
    assert all("cuda" in p.argv for p in full) and all("cuda" not in p.argv for p in dry)
    n = next(p for p in full if p.name == "fused").argv
    assert n[n.index("--n") + 1] == "1,2,4,8,16,32,64"  # HFTA's range


def test_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_suite.main(["--out", str(tmp_path / "s")]) == 2
    assert not (tmp_path / "s").exists()


def test_a_part_past_its_budget_is_stopped_and_recorded(tmp_path: Path) -> None:
    slow = gpu_suite.Part(
        name="sleep",
        argv=("timeit", "-n", "1", "-r", "1", "__import__('time').sleep(30)"),
        budget_s=1,
        what="x",
    )
    t0 = time.monotonic()
    res = gpu_suite.run_part(slow, tmp_path, deadline=time.monotonic() + 60)
    assert res.timed_out and not res.ok and time.monotonic() - t0 < 15
    late = gpu_suite.run_part(slow, tmp_path, deadline=time.monotonic())
    assert late.skipped and not late.ok


def test_dry_run_runs_every_part_and_writes_one_folder(tmp_path: Path) -> None:
    """The command a lent GPU gets, rehearsed: every part must succeed on the CPU."""
    out = tmp_path / "suite"
    proc = subprocess.run(
        [sys.executable, "-m", "plait.bench.gpu_suite", "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    doc = json.loads((out / "suite.json").read_text())
    failed = [(p["name"], p["log_tail"]) for p in doc["parts"] if not p["ok"]]
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-2000:])
    assert [p["name"] for p in doc["parts"]] == [p.name for p in gpu_suite.parts(dry_run=True)]
    for name in ("fused", "kfac", "dp"):
        assert (out / name / "results.json").is_file(), name
    assert "aggregate:" in (out / "logs" / "crossover.log").read_text()  # both jobs ran
    dp = json.loads((out / "dp" / "results.json").read_text())
    assert {r["link"] for r in dp} == {"model"} and {r["nodes"] for r in dp} == {2}
    with tarfile.open(tmp_path / "suite.tar.gz") as tar:
        assert "suite/suite.json" in tar.getnames()
    assert "| crossover |" in (out / "README.md").read_text()
