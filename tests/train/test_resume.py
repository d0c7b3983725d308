"""A worker killed mid-run: torchrun restarts the job and it resumes from the checkpoint,
ending exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from plait.cluster import Cluster, LaunchResult, launch


def _argv(ckpt: Path, out: Path) -> list[str]:
    return [
        "plait.train",
        "--workload",
        "resnet18",
        "--steps",
        "30",
        "--batch-size",
        "16",
        "--checkpoint",
        str(ckpt),
        "--checkpoint-every",
        "5",
        "--out",
        str(out),
        "--no-progress",
    ]


def _worker_pid(marker: str, rank: int) -> int | None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmd and f"\0RANK={rank}\0".encode() in b"\0" + env:
            return int(pid)
    return None


# The trainer's resume after a kill is also held by tests/faults/test_resume.py (every family,
# in processes) and tests/faults/test_restart.py (torchrun's restart at 4 nodes): this full
# emulated-cluster run is `make test-all` only.
@pytest.mark.slow
def test_resume_after_worker_is_killed(tmp_path: Path) -> None:
    ref_out, out = tmp_path / "ref.json", tmp_path / "run.json"
    ckpt = tmp_path / "ckpt"
    with Cluster.create(nodes=2, quiet=True) as cluster:
        ref = launch(
            cluster, _argv(tmp_path / "ref_ckpt", ref_out), module=True, timeout_s=300, quiet=True
        )
        assert ref.ok, ref.tail()

        holder: dict[str, LaunchResult] = {}

        def run() -> None:
            holder["res"] = launch(
                cluster, _argv(ckpt, out), module=True, max_restarts=2, timeout_s=300, quiet=True
            )

        t = threading.Thread(target=run)
        t.start()
        killed = None
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline and t.is_alive():
            if (ckpt / "step_00000010" / "MANIFEST.json").exists():
                pid = _worker_pid(str(ckpt), rank=1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = pid
            time.sleep(0.05)
        t.join(timeout=300)
    res = holder["res"]
    assert killed is not None, "the run finished before a worker could be killed"
    assert res.ok, res.tail()
    log = (res.log_dir / "node0.log").read_text()
    assert "resumed from" in log
    final, expected = json.loads(out.read_text()), json.loads(ref_out.read_text())
    assert final["resumed_from"] is not None and final["resumed_from"] >= 10
    assert final["steps"] == expected["steps"] == 30
    # same data order, same sums: the resumed run reproduces the uninterrupted one
    assert final["final"]["test_loss"] == expected["final"]["test_loss"]
    assert final["final"]["test_accuracy"] == expected["final"]["test_accuracy"]
