"""Fused sweeps on Optuna: persistence, partitions, pruning, and trials as if alone."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import optuna
import pytest

from plait.fused.sweep import (
    OptimizerKind,
    PrunerKind,
    SamplerKind,
    SearchSpace,
    SweepConfig,
    SweepTask,
    run_sweep,
    sweep_task,
    train_array,
)
from plait.fused.sweep.report import write_reports
from plait.fused.sweep.runner import _Data


def small_task(**space: object) -> SweepTask:
    return sweep_task("digits-mlp", SearchSpace(widths=(16,), **space))  # type: ignore[arg-type]


def test_sweep_persists_and_continues(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    cfg = SweepConfig(trials=5, epochs=2, storage=storage, study="s", max_models=4,
                      pruner=PrunerKind.NONE, progress=False)  # fmt: skip
    result = run_sweep(small_task(), cfg)
    assert [r.state for r in result.records] == ["COMPLETE"] * 5
    assert result.capacities == {"batch_size=32, width=16": 4}
    assert sorted(r.array_size for r in result.records) == [1, 4, 4, 4, 4]
    assert all(len(r.curve) == 2 and 0 <= r.curve[-1] <= 1 for r in result.records)
    study = optuna.load_study(study_name="s", storage=storage)
    assert len(study.trials) == 5
    assert {t.number: t.value for t in study.trials} == {r.number: r.value for r in result.records}

    more = run_sweep(small_task(), SweepConfig(**{**cfg.__dict__, "trials": 7}))
    assert [r.number for r in more.records] == [5, 6]  # the study continues where it was
    # asking for no more trials than it holds runs nothing, and says so (it used to print
    # "0 trials" without a word)
    with caplog.at_level(logging.WARNING, logger="plait.fused.sweep.runner"):
        same = run_sweep(small_task(), SweepConfig(**{**cfg.__dict__, "trials": 7}))
    assert same.records == []
    assert "already holds 7 trial(s)" in caplog.text and "--restart" in caplog.text

    paths = write_reports(result, cfg, "digits-mlp", tmp_path / "out")
    assert paths["png"].stat().st_size > 0
    assert "#0" in paths["markdown"].read_text()


def test_non_fusible_values_never_share_an_array(tmp_path: Path) -> None:
    cfg = SweepConfig(
        trials=8,
        epochs=1,
        storage=f"sqlite:///{tmp_path / 'db'}",
        max_models=8,
        sampler=SamplerKind.RANDOM,
        progress=False,
    )
    result = run_sweep(small_task(batch_sizes=(16, 64)), cfg)
    arrays: dict[int, set[int]] = {}
    for r in result.records:
        arrays.setdefault(r.array, set()).add(r.params["batch_size"])
    assert all(len(sizes) == 1 for sizes in arrays.values())
    assert {next(iter(s)) for s in arrays.values()} == {16, 64}


def test_pruned_trials_leave_the_array_and_the_rest_finish(tmp_path: Path) -> None:
    cfg = SweepConfig(trials=9, epochs=4, storage=f"sqlite:///{tmp_path / 'db'}",
                      max_models=9, pruner=PrunerKind.ASHA, progress=False)  # fmt: skip
    result = run_sweep(small_task(lr=(1e-4, 0.5)), cfg)
    states = [r.state for r in result.records]
    assert "PRUNED" in states and "COMPLETE" in states
    for r in result.records:
        if r.state == "PRUNED":
            assert len(r.curve) < 4 and r.value is None
        else:
            assert len(r.curve) == 4


def test_a_trial_trains_in_an_array_as_it_would_alone() -> None:
    task = small_task()
    data = _Data(task, "cpu")
    cfg = SweepConfig(trials=3, epochs=2, pruner=PrunerKind.NONE, progress=False)
    params = [{"lr": lr, "weight_decay": 1e-4, "momentum": 0.9, "batch_size": 32, "width": 16}
              for lr in (0.01, 0.05, 0.2)]  # fmt: skip

    def curves(which: list[int]) -> dict[float, list[float]]:
        study = optuna.create_study(direction="maximize")
        trials = [study.ask() for _ in range(3)]  # numbers 0, 1, 2 seed the weights
        records = train_array(task, [trials[i] for i in which], [params[i] for i in which],
                              data=data, cfg=cfg, study=study, array_id=1)  # fmt: skip
        return {r.params["lr"]: r.curve for r in records}

    together = curves([0, 1, 2])
    alone = curves([1])
    assert together[0.05] == pytest.approx(alone[0.05], abs=1e-6)


def test_memory_budget_too_small(tmp_path: Path) -> None:
    cfg = SweepConfig(trials=2, epochs=1, storage=f"sqlite:///{tmp_path / 'db'}",
                      memory_budget=1000, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="not even one model fits"):
        run_sweep(small_task(), cfg)


FACTORY = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from plait.workloads import DataInfo, DataSplit, Workload


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    y = (x[:, 0] > 0).long()
    return DataSplit(train=TensorDataset(x, y), test=None, name="toy",
                     info=DataInfo(input_shape=(8,), num_classes=2))


def build(info, *, hidden=4, dropout=0.0):
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(hidden, info.num_classes))


def workload():
    return Workload(name="toy", build=build, real=data, arch={"hidden": 4},
                    loss_fn=lambda out, y: nn.functional.cross_entropy(out, y))
"""


def test_a_user_workload_space_optimizer_sampler_and_pruner(tmp_path: Path) -> None:
    """Everything a user brings: a factory file, a suggest function, Adam, Optuna objects."""
    (tmp_path / "toy.py").write_text(FACTORY)

    def space(trial: optuna.Trial) -> dict[str, object]:
        return {
            "lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True),
            "betas": (0.9, trial.suggest_float("beta2", 0.9, 0.999)),
            "hidden": trial.suggest_categorical("hidden", [4, 8]),
            "dropout": trial.suggest_float("dropout", 0.0, 0.3),  # per model in one array
            "batch_size": 16,
        }

    sampler = optuna.samplers.RandomSampler(seed=3)
    pruner = optuna.pruners.NopPruner()
    cfg = SweepConfig(trials=4, epochs=1, storage=f"sqlite:///{tmp_path / 'db'}", max_models=4,
                      optimizer=OptimizerKind.ADAM, sampler=sampler, pruner=pruner,
                      progress=False)  # fmt: skip
    task = sweep_task(f"{tmp_path / 'toy.py'}:workload", fusible=("dropout",))
    result = run_sweep(task, cfg, space=space)
    assert cfg.sampler is sampler and cfg.optimizer is OptimizerKind.ADAM
    assert [r.state for r in result.records] == ["COMPLETE"] * 4
    for r in result.records:  # held out: a fifth of the 96 samples, scored per model
        assert r.value is not None and 0 <= r.value <= 1 and round(r.value * 19) == r.value * 19
    arrays: dict[int, set[object]] = {}
    for r in result.records:
        arrays.setdefault(r.array, set()).add(r.params["hidden"])
    assert all(len(h) == 1 for h in arrays.values())  # hidden is non-fusible, dropout not
    assert set(result.capacities) <= {"batch_size=16, hidden=4", "batch_size=16, hidden=8"}
    paths = write_reports(result, cfg, task.name, tmp_path / "out")
    config = json.loads(paths["json"].read_text())["config"]
    assert config["sampler"] == "RandomSampler" and config["optimizer"] == "adam"


def test_a_space_naming_nothing_usable_fails_before_the_study(tmp_path: Path) -> None:
    cfg = SweepConfig(trials=2, epochs=1, storage=f"sqlite:///{tmp_path / 'db'}",
                      optimizer=OptimizerKind.ADAGRAD, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="'momentum' is not an option of the adagrad"):
        run_sweep("digits-mlp", cfg, space=lambda t: {"lr": 0.1, "momentum": 0.9})
    assert not (tmp_path / "db").exists()
    with pytest.raises(ValueError, match="optimizer 'lbfgs': choose from sgd, adam"):
        SweepConfig(optimizer="lbfgs")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="or an optuna sampler"):
        SweepConfig(sampler="grid")  # type: ignore[arg-type]


def test_cli_space_file_and_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli import main

    spec = tmp_path / "space.toml"
    spec.write_text("lr = {low = 1e-3, high = 1e-2, log = true}\nwidth = 16\nbatch_size = 64\n")
    out = tmp_path / "report"
    argv = ["sweep", "--workload", "digits-mlp", "--space", str(spec), "--optimizer", "adamw",
            "--trials", "2", "--epochs", "1", "--storage", f"sqlite:///{tmp_path / 'db'}",
            "--out", str(out), "--no-progress", "--threads", "1"]  # fmt: skip
    assert main(argv) == 0
    trials = json.loads((out / "results.json").read_text())["trials"]
    assert {t["params"]["width"] for t in trials} == {16} and len(trials) == 2
    for bad, message in (
        (["--space", str(spec), "--lr", "1e-3,1e-2"], "drop --lr"),
        (["--optimizer", "adam", "--momentum", "0.9"], "adam optimizer has no momentum"),
        (["--workload", "imagenet"], "unknown sweep task or workload"),
        (["--workload", f"{tmp_path / 'none.py'}:f"], "does not exist"),
    ):
        with pytest.raises(SystemExit):
            main(["sweep", *bad])
        assert message in capsys.readouterr().err


def test_a_study_another_process_is_creating_is_opened_on_a_retry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two sweeps started together on a new SQLite file: the loser of the schema race
    meets "table ... already exists" (seen with two concurrent `plait sweep`); it retries
    and opens the study; other storage errors still fail at once."""
    from plait.fused.sweep import runner

    real = optuna.create_study
    calls: list[int] = []

    def racy(*args: object, **kw: object) -> optuna.Study:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("(sqlite3.OperationalError) table study_directions already exists")
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(runner.optuna, "create_study", racy)
    monkeypatch.setattr(runner.time, "sleep", lambda _s: None)
    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    study = runner._open_study("s", storage, SweepConfig(trials=1))
    assert study.study_name == "s" and len(calls) == 2

    def broken(*args: object, **kw: object) -> optuna.Study:
        calls.append(1)
        raise RuntimeError("no such driver")

    monkeypatch.setattr(runner.optuna, "create_study", broken)
    calls.clear()
    with pytest.raises(ValueError, match="no such driver"):
        runner._open_study("s", storage, SweepConfig(trials=1))
    assert len(calls) == 1
