"""examples/kfac_vision.py under torchrun at world size 2: trains 3 steps with K-FAC."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "kfac_vision.py"


def test_kfac_on_a_transformers_resnet_over_digits() -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*launcher, "--nproc-per-node", "2", str(SCRIPT), "--steps", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    out = done.stdout + done.stderr
    # torch 2.13 sometimes aborts a process at exit after its work succeeded: judge by the
    # done line every rank prints after its last collective, and by the exit code otherwise
    finished = all(f"rank {r}: done" in out for r in range(2))
    assert finished, out
    losses = [float(v) for v in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), out
    assert "held-out accuracy" in out and "inversions every" in out
