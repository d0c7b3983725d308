"""The example run configs in configs/: each parses and validates, and one trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.cli import VALIDATORS, parse_command_line

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def test_there_are_examples_for_train_and_bench() -> None:
    assert {p.name.split("-")[0] for p in CONFIGS} == {"train", "bench"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_validates(path: Path) -> None:
    command = path.name.split("-")[0]  # train-*.toml, bench-*.toml
    args = parse_command_line([command, "--config", str(path)])
    VALIDATORS[command](args)  # raises ValueError naming the flag on any bad value
    assert args.command == command


def scalars(log_dir: Path) -> dict[str, list[float]]:
    """The scalar series TensorBoard event files under `log_dir` hold, by tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_train_from_a_config_writes_tensorboard_and_trace(tmp_path: Path) -> None:
    """The ACP-SGD example, shortened on the command line, on two loopback nodes."""
    tb, trace = tmp_path / "tb", tmp_path / "trace.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RANK", None)
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "train",
        "--config",
        str(CONFIGS[0].parent / "train-mlp-acpsgd.toml"),
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--no-progress",
        "--out",
        str(tmp_path / "m.json"),
        "--tensorboard",
        str(tb),
        "--trace",
        str(trace),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    series = scalars(tb)
    assert len(series["train/loss"]) == 4
    assert all(b > 0 for b in series["comm/bytes_per_step"])  # two ranks exchange factors
    assert len(series["eval/test_accuracy"]) == 2 and len(series["epoch/samples_per_s"]) == 1
    assert "epoch" in proc.stdout + proc.stderr  # the per-epoch line, logged by rank 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert {"compute", "comm", "compress", "optim"} <= {e["cat"] for e in events if e["ph"] == "X"}
