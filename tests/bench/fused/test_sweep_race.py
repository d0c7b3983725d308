"""The sweep race: its search space, run order and summary on synthetic runs, and one
tiny race of real ``plait sweep`` processes."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import optuna
import pytest

from plait.bench.fused import sweep_race
from plait.bench.fused.sweep_race import (
    LR_RANGE,
    SPACE_TARGET,
    WEIGHT_DECAY_RANGE,
    Mode,
    RaceConfig,
    RunResult,
    SweepRaceError,
    TrialValue,
    grid_point,
    grid_space,
    race_order,
    summarize,
    sweep_command,
)
from plait.fused.sweep import check_space, load_space, sweep_task

F, S, C = Mode.FUSED, Mode.SEQUENTIAL, Mode.CONCURRENT


def _ask(study: optuna.Study, n: int) -> list[dict[str, object]]:
    return [grid_space(study.ask()) for _ in range(n)]


def test_space_gives_32_distinct_values_that_depend_on_the_trial_number_only() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Two studies whose samplers differ: the values still follow the trial numbers.
    a = _ask(optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1)), 32)
    b = _ask(optuna.create_study(sampler=optuna.samplers.TPESampler(seed=7)), 32)
    assert a == b
    points = [(p["lr"], p["weight_decay"]) for p in a]
    assert points == [grid_point(n) for n in range(32)]
    assert len(set(points)) == 32
    for lr, wd in points:
        assert LR_RANGE[0] <= lr <= LR_RANGE[1]
        assert WEIGHT_DECAY_RANGE[0] <= wd <= WEIGHT_DECAY_RANGE[1]
    # Spread over the log range, not bunched at one end.
    logs = sorted(math.log10(lr) for lr, _ in points)
    assert logs[0] < -2.3 and logs[-1] > -0.7
    assert all(p["momentum"] == 0.9 and p["batch_size"] == 32 for p in a)

    # Recorded through the trial, as single-valued ranges; beyond 32 still defined.
    study = optuna.create_study()
    trials = [study.ask() for _ in range(40)]
    params = grid_space(trials[35])
    assert trials[35].params == {"lr": params["lr"], "weight_decay": params["weight_decay"]}
    assert grid_point(35) not in points
    with pytest.raises(ValueError, match="-1"):
        grid_point(-1)


def test_space_loads_by_module_path_and_passes_the_sweeps_checks() -> None:
    assert load_space(SPACE_TARGET) is grid_space
    params = check_space(sweep_task("digits-cnn", load_space(SPACE_TARGET)), "sgd")
    assert (params["lr"], params["weight_decay"]) == grid_point(0)


def test_modes_rotate_so_none_always_goes_first() -> None:
    assert race_order(3) == [
        (0, F),
        (0, S),
        (0, C),
        (1, S),
        (1, C),
        (1, F),
        (2, C),
        (2, F),
        (2, S),
    ]
    assert race_order(1) == [(0, F), (0, S), (0, C)]


def _run(
    mode: Mode, repeat: int, seconds: float, values: dict[int, float], busy: float = 0.0
) -> RunResult:
    return RunResult(
        mode=mode,
        repeat=repeat,
        seconds=seconds,
        processes=2 if mode is C else 1,
        threads=1 if mode is C else 2,
        sweep_seconds=[seconds - 5.0],
        others_busy=busy,
        trials=[
            TrialValue(number=n, state="COMPLETE", value=v, process=n % 2)
            for n, v in values.items()
        ]
        + [TrialValue(number=99, state="PRUNED", value=None, process=0)],
    )


VALUES = {0: 0.90, 1: 0.95, 2: 0.95, 3: 0.80}  # trials 1 and 2 tie: the best is #1


def test_summary_takes_medians_ratios_and_checks_the_best_trials_agree() -> None:
    runs = [
        _run(F, 0, 10.0, VALUES),
        _run(S, 0, 30.0, VALUES),
        _run(C, 0, 20.0, {**VALUES, 3: 0.81}, busy=0.3),
        _run(S, 1, 36.0, VALUES),
        _run(C, 1, 25.0, VALUES),
        _run(F, 1, 14.0, {**VALUES, 1: 0.953}),
        _run(C, 2, 22.0, VALUES),
        _run(F, 2, 11.0, VALUES),
        _run(S, 2, 31.0, VALUES),
    ]
    assert runs[0].best == TrialValue(number=1, state="COMPLETE", value=0.95, process=1)
    summary = summarize(runs, tolerance=0.01)
    fused, seq, conc = (summary.mode(m) for m in Mode)
    assert (fused.seconds.median, fused.seconds.min, fused.seconds.max) == (11.0, 10.0, 14.0)
    assert (seq.seconds.median, seq.seconds.min, seq.seconds.max) == (31.0, 30.0, 36.0)
    assert conc.seconds.median == 22.0 and conc.sweep_seconds.median == 17.0
    assert fused.vs_fused == 1.0
    assert seq.vs_fused == pytest.approx(31 / 11) and conc.vs_fused == pytest.approx(2.0)
    assert fused.best_numbers == [1, 1, 1] and fused.best_values == [0.95, 0.953, 0.95]
    assert conc.trials == [4, 4, 4]  # the pruned trial has no value
    assert conc.others_busy == 0.3 and seq.others_busy == 0.0
    assert conc.max_trial_diff == pytest.approx(0.01) and seq.max_trial_diff == 0.0
    assert summary.agree and summary.same_trial
    assert summary.best_spread == pytest.approx(0.003)

    table = sweep_race.markdown_table(summary, RaceConfig(threads=2))
    assert "| sequential | 1 x 2 | 1 | 31.0 | 30.0-36.0 | 2.82x |" in table
    assert "| concurrent | 2 x 1 | 1 | 22.0 | 20.0-25.0 | 2.00x |" in table
    assert "| fused | 1 x 2 | 32 | 11.0 |" in table and "0.9500-0.9530" in table
    assert "The best values agree" in table and "the same best trial" in table
    assert "30% of the machine's CPU" in table

    # Another best trial at a value within the tolerance agrees, but says so; best values
    # further apart than the tolerance disagree.
    other = summarize([*runs, _run(S, 3, 33.0, {**VALUES, 0: 0.955})], tolerance=0.01)
    assert other.agree and not other.same_trial
    assert "best trials [0, 1] (near-ties" in sweep_race.markdown_table(other, RaceConfig())
    far = _run(S, 3, 33.0, {**VALUES, 1: 0.97})
    assert not summarize([*runs, far], tolerance=0.01).agree
    assert summarize([*runs, far], tolerance=0.03).agree
    with pytest.raises(ValueError, match="no runs"):
        summarize([], tolerance=0.01)


def test_reports_of_a_synthetic_race(tmp_path: Path) -> None:
    runs = [_run(m, 0, t, VALUES) for m, t in ((F, 10.0), (S, 30.0), (C, 20.0))]
    cfg = RaceConfig(trials=4, epochs=1, repeats=1, threads=2)
    summary = summarize(runs, tolerance=cfg.tolerance)
    paths = sweep_race.write_results(tmp_path, cfg, runs, summary, command="python -m x")
    data = json.loads(paths["json"].read_text())
    assert data["summary"]["agree"] is True
    assert [r["mode"] for r in data["runs"]] == ["fused", "sequential", "concurrent"]
    assert data["runs"][0]["best_number"] == 1
    assert {"torch", "commit", "command", "machine"} <= set(data)
    assert data["machine"]["cpus"] >= 1 and data["command"] == "python -m x"
    text = paths["markdown"].read_text()
    assert "4-trial sweep of digits-cnn" in text and "3.00x" in text
    assert paths["png"].stat().st_size > 0


def test_commands_of_each_mode() -> None:
    cfg = RaceConfig(trials=8, epochs=2, concurrent=2, threads=4, seed=3)
    out = Path("/tmp/o")

    def command(mode: Mode) -> list[str]:
        return sweep_command(cfg, mode, storage="sqlite:///s.db", study="st", out=out)

    def flag(args: list[str], name: str) -> str:
        return args[args.index(name) + 1]

    for mode, models, threads in ((F, "32", "4"), (S, "1", "4"), (C, "1", "2")):
        args = command(mode)
        assert args[:4] == [sys.executable, "-m", "plait", "sweep"]
        assert flag(args, "--max-models") == models and flag(args, "--threads") == threads
        assert flag(args, "--trials") == "8" and flag(args, "--epochs") == "2"
        assert flag(args, "--pruner") == "none" and flag(args, "--space") == SPACE_TARGET
        assert flag(args, "--seed") == "3" and "--no-progress" in args
        assert "--restart" not in args  # it would delete a sibling process's trials


def test_a_factory_file_is_named_so_that_a_run_folder_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run's processes start in their own folder: a relative factory file is passed
    by its absolute path, and the starting folder joins their import path (for a module
    there); a registry name or a module spec passes as it is."""
    monkeypatch.chdir(tmp_path)
    out = Path("/tmp/o")
    for workload, expected in (
        ("models/mine.py:make", f"{tmp_path}/models/mine.py:make"),
        ("mywork:make", "mywork:make"),
        ("digits-cnn", "digits-cnn"),
    ):
        cfg = RaceConfig(trials=2, epochs=1, workload=workload)
        args = sweep_command(cfg, F, storage="sqlite:///s.db", study="st", out=out)
        assert args[args.index("--workload") + 1] == expected
    assert sweep_race._environment()["PYTHONPATH"].split(":")[0] == str(tmp_path)


@pytest.mark.parametrize(
    ("argv", "bad"),
    [
        (["--trials", "0"], "--trials 0"),
        (["--concurrent", "1"], "--concurrent 1"),
        (["--trials", "2", "--concurrent", "3"], "--concurrent 3"),
        (["--threads", "1", "--concurrent", "2"], "--threads 1"),
        (["--timeout", "0"], "--timeout 0"),
        (["--tolerance", "-1"], "--tolerance -1"),
        (["--workload", "nope"], "'nope'"),
    ],
)
def test_bad_arguments_are_refused_up_front(
    argv: list[str], bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        sweep_race.main(argv)
    assert exc.value.code == 2
    assert bad in capsys.readouterr().err


def test_a_failed_or_hung_process_raises_with_its_output(tmp_path: Path) -> None:
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    commands = [
        [sys.executable, "-c", "import time; time.sleep(30)"],
        [sys.executable, "-c", "import sys; print('it broke here'); sys.exit(3)"],
    ]

    def start() -> list[sweep_race.subprocess.Popen[bytes]]:
        procs = []
        for c, path in zip(commands, logs, strict=True):
            with path.open("wb") as f:
                procs.append(sweep_race.subprocess.Popen(c, stdout=f, stderr=f))
        return procs

    procs = start()
    t0 = time.perf_counter()
    with pytest.raises(SweepRaceError, match=r"(?s)status 3.*it broke here"):
        sweep_race._wait_all(
            procs, commands, logs, deadline=time.perf_counter() + 20, what="x", timeout=20
        )
    assert all(p.poll() is not None for p in procs)  # the sleeper was killed, not awaited
    assert time.perf_counter() - t0 < 15

    commands[1] = [sys.executable, "-c", "print('still going', flush=True); import time; "]
    commands[1][-1] += "time.sleep(30)"
    commands.reverse()
    logs.reverse()
    procs = start()
    with pytest.raises(SweepRaceError, match=r"(?s)timed out after 1 s.*still going"):
        sweep_race._wait_all(
            procs, commands, logs, deadline=time.perf_counter() + 1, what="x", timeout=1
        )
    assert all(p.poll() is not None for p in procs)


def test_a_tiny_race_runs_every_mode_to_the_same_best_trial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # OpenMP threads that wait by spinning take several times longer on a machine busy
    # with other work (the test suite's own workers, say); this test times nothing, so
    # its two-thread sweeps wait asleep.
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    out = tmp_path / "race"
    argv = ["--trials", "4", "--epochs", "1", "--repeats", "1", "--concurrent", "2"]
    argv += ["--threads", "2", "--max-models", "4", "--out", str(out)]
    assert sweep_race.main(argv) == 0
    assert "| concurrent | 2 x 1 | 1 |" in capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert [r["mode"] for r in runs] == ["fused", "sequential", "concurrent"]
    for r in runs:
        numbers = [t["number"] for t in r["trials"] if t["state"] == "COMPLETE"]
        # Concurrent processes that ask at the same moment may overshoot the total.
        assert set(range(4)) <= set(numbers) and len(numbers) <= 5
        assert r["seconds"] > 0
    assert {t["process"] for t in runs[2]["trials"]} == {0, 1}  # both processes trained
    # Every mode trains trial n from the same weights on the same batches with the same
    # hyper-parameters; only the summation order of the fused kernels (4 models, or 1)
    # may differ. After one epoch that moves an accuracy by a few of the 359 validation
    # samples at most (1/359 each), so 0.01 (3 samples) is the tolerance; the best
    # trial, well clear of the others on this space, must be the same one.
    assert len({r["best_number"] for r in runs}) == 1
    values = [r["best_value"] for r in runs]
    assert max(values) - min(values) <= 0.01
    assert data["summary"]["agree"] is True
    assert (out / "results.md").read_text().count("| fused |") == 1
    assert (out / "results.png").stat().st_size > 0
