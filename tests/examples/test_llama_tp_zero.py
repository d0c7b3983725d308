"""The tensor + ZeRO Llama example runs unchanged under plain torchrun at world size 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from plait.cluster.launch import free_port
from tests.examples import completed

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_tp_zero.py"


def test_example_trains_under_torchrun() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(EXAMPLE),
        "--steps",
        "3",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert completed(proc), proc.stderr[-3000:]
    losses = [
        float(v) for v in re.findall(r"step \d+ loss ([0-9.]+) \(plan [^)]*tp=2", proc.stderr)
    ]
    assert len(losses) == 3 and losses[-1] < losses[0]
