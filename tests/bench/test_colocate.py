from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from plait.bench.colocate import Job, JobRun, Mode, jain_index, window_rates
from plait.bench.records import Comparison


def _run(times: list[float]) -> JobRun:
    return JobRun(job="j", mode=Mode.CROSSOVER, ok=True, elapsed_s=0.0, step_end_unix=times)


def test_window_rates_count_steps_inside_the_common_window() -> None:
    a = _run([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # 1 step/s, warm-up ends at t=1
    b = _run([0.5, 2.0, 4.0, 6.0, 8.0])  # 0.5 step/s, warm-up ends at t=2
    rates, window = window_rates([a, b], warmup=1)
    assert window == pytest.approx(4.0)  # from t=2 (b's warm-up) to t=6 (a's end)
    assert rates == pytest.approx([4 / 4, 2 / 4])
    with pytest.raises(ValueError, match="overlap"):
        window_rates([_run([0, 1, 2]), _run([5, 6, 7])], warmup=0)


def test_ideal_speedup_matches_the_two_job_cycle() -> None:
    # cA=1, mA=1, cB=1, mB=1: ideal cycle max(1,1)+max(1,1)=2 for two steps that take 4
    comp = Comparison(
        jobs=["a", "b"],
        bandwidth="x",
        rate="",
        steps=10,
        warmup=1,
        repeats=1,
        alone_steps_per_s=[0.5, 0.5],
        alone_step_s=[2.0, 2.0],
        compute_s=[1.0, 1.0],
    )
    assert comp.ideal_speedup() == pytest.approx(2.0)
    # compute-bound jobs gain nothing: cycle = cA + cB
    comp.compute_s, comp.alone_step_s = [1.0, 1.0], [1.0, 1.0]
    assert comp.ideal_speedup() == pytest.approx(1.0)


def test_jain_index() -> None:
    assert jain_index([1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0]) == pytest.approx(0.5)


def test_job_specs(tmp_path: Path) -> None:
    job = Job.parse("resnet18/ssgd", 0)
    argv, module = job.argv(steps=5, out=tmp_path / "o.json", group="g", tmp=tmp_path)
    assert module and argv[:3] == ["plait.train", "--workload", "resnet18"]
    assert argv[argv.index("--crossover") + 1] == "g"
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps({"workload": "mlp", "steps": 3}))
    argv, _ = Job.parse(str(cfg), 1).argv(
        steps=5, out=tmp_path / "o.json", group=None, tmp=tmp_path
    )
    assert json.loads(Path(argv[-1]).read_text())["crossover"] is None
    cmd = Job.parse("my_job.py --lr 0.1", 2)
    assert cmd.argv(steps=5, out=tmp_path, group="g", tmp=tmp_path) == (
        ["my_job.py", "--lr", "0.1"],
        False,
    )
    with pytest.raises(ValueError, match="unknown workload"):
        Job.parse("alexnet/ssgd", 0)
    with pytest.raises(ValueError, match="unknown strategy"):
        Job.parse("mlp/bogus", 0)


def test_crossover_run_end_to_end(tmp_path: Path) -> None:
    trace = tmp_path / "xo.json"
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "crossover",
        "run",
        "mlp/ssgd",
        "gpt/ssgd",
        "--nodes",
        "2",
        "--steps",
        "4",
        "--trace",
        str(trace),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PLAIT_TOKEN_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "aggregate:" in proc.stdout
    assert proc.stdout.count("'acquisitions': 4") == 2  # each job gated every step
    names = {
        e["args"]["name"]
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("name") == "process_name"
    }
    assert {"job0:mlp/ssgd rank 0", "job1:gpt/ssgd rank 1"} <= names
    assert trace.with_suffix(".png").stat().st_size > 0  # the interleaving plot


def test_balanced_steps_give_every_job_the_slowest_ones_duration() -> None:
    from plait.bench.colocate import balanced_steps

    assert balanced_steps(12, [1.0, 0.5, 0.3]) == [12, 24, 40]
    assert balanced_steps(12, [0.5, 0.5]) == [12, 12]
    with pytest.raises(ValueError, match="positive"):
        balanced_steps(12, [1.0, 0.0])


def test_compare_interleaves_repeats_and_takes_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    """Synthetic step times through `compare`: every repeat runs each job alone then each
    mode, and each figure is the median over repeats of rates normalised per repeat."""
    from plait.bench import colocate

    calls: list[tuple[str, int, object]] = []

    def fake_runs(
        cluster: object, jobs: list[Job], *, mode: Mode, steps: object, **kw: object
    ) -> list[JobRun]:
        rep = sum(1 for c in calls if c[0] == "crossover" and c[1] == 2)
        calls.append((str(mode), len(jobs), steps))
        # alone: job0 1 step/s (2 in repeat 1), job1 0.5 step/s; co-located: half each
        out = []
        for job in jobs:
            fast = 1.0 if job.name.startswith("job0") else 0.5
            if len(jobs) == 1 and rep == 1 and fast == 1.0:
                fast = 2.0
            rate = fast if len(jobs) == 1 else fast / 2
            ends = [i / rate for i in range(41)]
            token = {"hold_s": 4.0, "acquisitions": 8} if len(jobs) == 1 else None
            out.append(
                JobRun(
                    job=job.name,
                    mode=mode,
                    ok=True,
                    elapsed_s=40.0,
                    step_end_unix=ends,
                    token=token,
                )
            )
        return out

    class Busy:
        def __enter__(self) -> Busy:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def busy(self, start: float, end: float) -> float:
            return 0.5

    monkeypatch.setattr(colocate, "_run_jobs", fake_runs)
    monkeypatch.setattr(colocate, "CpuSampler", Busy)
    cluster: Any = SimpleNamespace(cid="c", network=SimpleNamespace(bandwidth="slow", rate="1mbit"))
    comp = colocate.compare(
        cluster,
        ["mlp/ssgd", "gpt/ssgd"],
        steps=10,
        warmup=1,
        repeats=2,
        progress=False,
    )
    order = [(m, n) for m, n, _ in calls]
    one_repeat = [("crossover", 1), ("crossover", 1), ("uncoordinated", 2), ("crossover", 2)]
    assert order == one_repeat * 2
    assert calls[2][2] == [20, 10]  # the faster job runs twice the steps (first repeat)
    assert comp.alone_steps_per_s == pytest.approx([1.5, 0.5])  # medians of (1, 2), (0.5, 0.5)
    assert comp.compute_s == [0.5, 0.5]
    assert comp.alone_cpu_busy == [0.5, 0.5]
    xo = comp.modes["crossover"]
    # repeat 0: 0.5/1 + 0.25/0.5 = 1.0; repeat 1: 0.5/2 + 0.25/0.5 = 0.75
    assert xo.speedup_runs == pytest.approx([1.0, 0.75])
    assert xo.speedup_vs_sequential == pytest.approx(0.875)
    assert xo.normalised == pytest.approx([0.375, 0.5])
    assert xo.steps_per_s == pytest.approx([0.5, 0.25]) and xo.cpu_busy == 0.5
    assert comp.to_dict()["modes"]["crossover"]["fairness"] == pytest.approx(
        jain_index([0.375, 0.5])
    )
