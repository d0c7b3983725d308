"""examples/lightning_acpsgd.py under torchrun at world size 2: Lightning's DDP averages
with plait's compressor (its step counter moves only when its hook runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples import completed

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "lightning_acpsgd.py"


def test_lightning_ddp_uses_the_plait_hook(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--max-steps",
        "4",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    done = subprocess.run(
        cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False
    )
    out = done.stdout + done.stderr
    assert completed(done), out
    for rank in range(2):
        assert f"rank {rank}: 4 steps averaged by acpsgd" in out, out
