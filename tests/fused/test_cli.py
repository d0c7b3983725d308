"""`plait sweep` and `plait bench-fused` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli import main


def test_sweep_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    code = main(["sweep", "--task", "digits-mlp", "--trials", "3", "--epochs", "1",
                 "--widths", "16", "--storage", f"sqlite:///{tmp_path / 'db'}", "--study", "cli",
                 "--out", str(out), "--no-progress", "--threads", "1"])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "3 trials" in text and "best: trial #" in text
    data = json.loads((out / "results.json").read_text())
    assert len(data["trials"]) == 3 and (out / "curves.png").exists()
    # the study is complete: a rerun trains nothing, unless asked to restart it
    argv = ["sweep", "--task", "digits-mlp", "--trials", "3", "--epochs", "1", "--widths", "16",
            "--storage", f"sqlite:///{tmp_path / 'db'}", "--study", "cli", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads((out / "results.json").read_text())["trials"] == []
    assert main([*argv, "--restart"]) == 0
    assert len(json.loads((out / "results.json").read_text())["trials"]) == 3


def test_bench_fused_command(tmp_path: Path) -> None:
    argv = ["bench-fused", "--models", "mlp", "--n", "1,2", "--strategies", "fused,serial",
            "--steps", "1", "--rounds", "1", "--warmup", "0", "--out", str(tmp_path)]  # fmt: skip
    code = main(argv)
    assert code == 0
    records = json.loads((tmp_path / "results.json").read_text())
    assert {(r["n"], r["strategy"]) for r in records} == {(1, "fused"), (1, "serial"),
                                                          (2, "fused"), (2, "serial")}  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sweep", "--task", "imagenet"], "unknown sweep task"),
        (["sweep", "--lr", "0.1"], "--lr takes a range"),
        (["bench-fused", "--models", "alexnet"], "unknown benchmark model"),
    ],
)
def test_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
