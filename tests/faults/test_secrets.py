"""Storage credentials never reach output or records."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from plait.fused.sweep import PrunerKind, SearchSpace, SweepConfig, digits_task, run_sweep
from plait.fused.sweep.report import write_reports
from plait.fused.sweep.runner import delete_study
from plait.fused.sweep.storage import mask_secrets, mask_url


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://user:pass@host/db", "postgresql://user:***@host/db"),
        ("postgresql+psycopg2://u:p%40ss@h:5432/d", "postgresql+psycopg2://u:***@h:5432/d"),
        ("mysql://u:p@ss/w:rd@host/db", "mysql://u:***@host/db"),  # unescaped @ and /
        ("postgresql://user@host/db", "postgresql://user@host/db"),  # no password
        (
            "postgresql://h/db?user=u&password=s3cret&x=1",
            "postgresql://h/db?user=u&password=***&x=1",
        ),
        ("sqlite:///runs/plait-sweeps.db", "sqlite:///runs/plait-sweeps.db"),
        ("not a url", "not a url"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_mask_secrets_in_free_text() -> None:
    url = "postgresql://u:hunter22@db.example/optuna"
    text = f"plait sweep --storage={url} --trials 4; password 'hunter22' rejected"
    out = mask_secrets(text, url)
    assert "hunter22" not in out
    assert "--storage=postgresql://u:***@db.example/optuna" in out


@pytest.mark.filterwarnings("ignore:Query string argument")
def test_sweep_records_and_reports_hold_no_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A SQLite URL is the only kind at hand; its "query" carries the secret, as an RDB
    # URL's password parameter would.
    secret = "hunter22"
    storage = f"sqlite:///{tmp_path / 'db'}?password={secret}"
    monkeypatch.setattr(sys, "argv", ["plait", "sweep", "--storage", storage])
    cfg = SweepConfig(
        trials=2,
        epochs=1,
        storage=storage,
        study="s",
        max_models=2,
        pruner=PrunerKind.NONE,
        progress=False,
    )
    task = digits_task("digits-mlp", SearchSpace(widths=(16,)))
    with caplog.at_level(logging.DEBUG):
        result = run_sweep(task, cfg)
    assert secret not in result.storage and result.storage.endswith("password=***")
    paths = write_reports(result, cfg, task.name, tmp_path / "out")
    for path in (paths["json"], paths["markdown"]):
        assert secret not in path.read_text(), path
    data = json.loads(paths["json"].read_text())
    assert data["storage"] == data["config"]["storage"] == mask_url(storage)
    assert "password=***" in data["command"]
    assert secret not in caplog.text


def test_storage_errors_do_not_quote_the_password(tmp_path: Path) -> None:
    storage = "notadialect://user:hunter22@host/db"
    cfg = SweepConfig(trials=1, epochs=1, storage=storage, study="s", progress=False)
    with pytest.raises(ValueError, match="cannot open Optuna storage") as info:
        run_sweep(digits_task("digits-mlp", SearchSpace(widths=(16,))), cfg)
    assert "hunter22" not in str(info.value)
    assert "notadialect://user:***@host/db" in str(info.value)
    with pytest.raises(ValueError, match="cannot open Optuna storage") as info:
        delete_study("s", storage)
    assert "hunter22" not in str(info.value)
