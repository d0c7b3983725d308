"""examples/ddp_acpsgd.py under torchrun at world size 2: trains, snapshots, resumes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.examples import completed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "ddp_acpsgd.py"


def _torchrun(snapshots: Path, epochs: int) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--epochs",
        str(epochs),
        "--max-steps",
        "3",
        "--snapshot-dir",
        str(snapshots),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert completed(done), done.stdout + done.stderr
    return done.stdout + done.stderr


def test_trains_then_resumes_from_its_snapshot(tmp_path: Path) -> None:
    out = _torchrun(tmp_path, epochs=1)
    assert "epoch 1:" in out
    assert "resumed" not in out
    for r in range(2):
        state = torch.load(tmp_path / f"rank{r}-of2.pt", weights_only=True)
        assert state["epoch"] == 1
        # ACP-SGD's state travels in the model's state dict: 3 steps of epoch 1
        assert state["model"]["plait_compressor"]["state"]["steps"] == 3

    out = _torchrun(tmp_path, epochs=2)
    assert "rank 0: resumed" in out and "rank 1: resumed" in out
    assert "after epoch 1" in out
    assert "epoch 2:" in out and "epoch 1:" not in out  # epoch 1 is not trained again
    for r in range(2):
        state = torch.load(tmp_path / f"rank{r}-of2.pt", weights_only=True)
        assert state["epoch"] == 2
        # the compressor's step counter went on from the snapshot's, not from 0
        assert state["model"]["plait_compressor"]["state"]["steps"] == 6
        assert state["optimizer"]["state"]  # momentum buffers were saved and restored
