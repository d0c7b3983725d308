"""However a job is stopped, nothing of it is left: processes, namespaces, links.

Each test starts `plait run` as a separate process (a job in its own session, as from a
shell), waits until every worker runs, stops it one way or another and checks what is
left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from plait._proc import pid_alive
from plait.cluster import Cluster
from plait.cluster.netns import _links, _namespaces

pytestmark = pytest.mark.cluster

SLEEPER = textwrap.dedent(
    """
    import json, os, sys, time
    rank = os.environ["RANK"]
    info = {"pid": os.getpid(), "agent": os.getppid(), "cid": os.environ["PLAIT_CLUSTER"]}
    with open(os.path.join(sys.argv[1], f"ready.{rank}.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(sys.argv[1], f"ready.{rank}.tmp"),
               os.path.join(sys.argv[1], f"ready.{rank}"))
    time.sleep(600)
    """
)


def _plait(*args: str) -> list[str]:
    return [sys.executable, "-m", "plait.cli", *args]


def _start_job(tmp: Path, nodes: int = 2) -> tuple[subprocess.Popen[bytes], list[dict[str, Any]]]:
    """`plait run --nodes N -- sleeper`, once every worker runs: (the parent, its workers)."""
    script = tmp / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen(
        _plait("run", "--nodes", str(nodes), "--", str(script), str(tmp)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    end = time.monotonic() + 90
    ready = [tmp / f"ready.{r}" for r in range(nodes)]
    while not all(p.exists() for p in ready):
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            err = proc.stderr.read().decode() if proc.stderr else ""
            pytest.fail(f"the job did not start (exit {proc.returncode}):\n{err[-3000:]}")
        time.sleep(0.1)
    return proc, [json.loads(p.read_text()) for p in ready]


def _gone(pids: list[int], within_s: float = 5.0) -> bool:
    end = time.monotonic() + within_s
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _no_launch_threads(within_s: float = 1.0) -> bool:
    import threading

    end = time.monotonic() + within_s
    while any(t.name.startswith("launch-") for t in threading.enumerate()):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _cluster_left(cid: str) -> list[str]:
    names = [n for n in _namespaces() if n.startswith(f"plait-{cid}-")]
    return names + [n for n in _links() if n.startswith((f"plb{cid}", f"plp{cid}"))]


def _kill_everything(workers: list[dict[str, Any]]) -> None:
    for w in workers:
        for pid in (w["pid"], w["agent"]):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM])
def test_signal_stops_the_job_and_removes_the_cluster(tmp_path: Path, sig: int) -> None:
    proc, workers = _start_job(tmp_path)
    cid = workers[0]["cid"]
    try:
        assert _cluster_left(cid)
        t0 = time.monotonic()
        os.kill(proc.pid, sig)
        proc.wait(timeout=20)
        assert time.monotonic() - t0 < 15
        assert proc.returncode != 0
        assert _gone([w["pid"] for w in workers] + [w["agent"] for w in workers])
        assert _cluster_left(cid) == []
    finally:
        proc.kill()
        _kill_everything(workers)


def test_second_ctrl_c_does_not_orphan_the_agents(tmp_path: Path) -> None:
    proc, workers = _start_job(tmp_path)
    cid = workers[0]["cid"]
    try:
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=20)
        assert _gone([w["pid"] for w in workers] + [w["agent"] for w in workers])
        assert _cluster_left(cid) == []
    finally:
        proc.kill()
        _kill_everything(workers)


@pytest.mark.parametrize("then", ["cluster-down", "next-run"])
def test_after_kill_9_the_dead_cluster_goes_and_a_live_one_stays(tmp_path: Path, then: str) -> None:
    with Cluster(nodes=1) as live:  # a job of this (live) process
        proc, workers = _start_job(tmp_path)
        cid = workers[0]["cid"]
        try:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            # agents die with plait, workers with their agent
            assert _gone([w["agent"] for w in workers] + [w["pid"] for w in workers])
            assert _cluster_left(cid)  # nobody tore the cluster down
            if then == "cluster-down":
                done = subprocess.run(
                    _plait("cluster", "down"), check=False, capture_output=True, timeout=60
                )
            else:
                (tmp_path / "noop.py").write_text("pass\n")
                done = subprocess.run(
                    _plait("run", "--nodes", "1", "--", str(tmp_path / "noop.py")),
                    check=False,
                    capture_output=True,
                    timeout=120,
                )
            assert done.returncode == 0, done.stderr.decode()[-2000:]
            assert _cluster_left(cid) == []
            assert live.netns(0) in _namespaces()
            assert _cluster_left(live.cid)
        finally:
            proc.kill()
            _kill_everything(workers)


def test_cluster_down_kills_what_runs_in_the_namespaces(tmp_path: Path) -> None:
    c = Cluster(nodes=2, persistent=True).up()
    try:
        sleepers = [
            subprocess.Popen([*c.exec_prefix(i), "sleep", "600"], start_new_session=True)
            for i in range(2)
        ]
        done = subprocess.run(
            _plait("cluster", "down"), check=False, capture_output=True, timeout=60
        )
        assert done.returncode == 0, done.stderr.decode()
        for p in sleepers:
            p.wait(timeout=10)  # killed, not left running in an unnamed namespace
        assert _cluster_left(c.cid) == []
    finally:
        for p in sleepers:
            p.kill()
        c.down()


def test_worker_dies_with_its_agent(tmp_path: Path) -> None:
    proc, workers = _start_job(tmp_path, nodes=1)
    try:
        os.kill(workers[0]["agent"], signal.SIGKILL)
        assert _gone([workers[0]["pid"]])
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
        _kill_everything(workers)


def test_ctrl_c_of_co_located_jobs_stops_them_within_seconds(tmp_path: Path) -> None:
    import _thread
    import threading

    from plait.bench.colocate import Mode, run_colocated

    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    ready = [d / "ready.0" for d in dirs]
    interrupted: list[float] = []

    def interrupt_when_running() -> None:
        end = time.monotonic() + 90
        while not all(p.exists() for p in ready) and time.monotonic() < end:
            time.sleep(0.1)
        interrupted.append(time.monotonic())
        _thread.interrupt_main()

    threading.Thread(target=interrupt_when_running, daemon=True).start()
    with Cluster(nodes=1) as c:
        with pytest.raises(KeyboardInterrupt):
            run_colocated(
                c, [f"{script} {d}" for d in dirs], mode=Mode.UNCOORDINATED, timeout_s=300
            )
        workers = [json.loads(p.read_text()) for p in ready]
        try:
            assert _gone([w["pid"] for w in workers] + [w["agent"] for w in workers])
            # each launch's teardown has ended; its thread is at most returning
            assert _no_launch_threads()
            assert time.monotonic() - interrupted[0] < 15
        finally:
            _kill_everything(workers)


@pytest.mark.parametrize("delay_s", [0.3, 0.6, 1.0])
def test_ctrl_c_in_the_first_instant_stops_the_command(delay_s: float, tmp_path: Path) -> None:
    """A Ctrl-C while the command still imports torch used to be swallowed in about half
    of the tries: the job then built its cluster and trained to the end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait", "train", "--workload", "mlp", "--steps", "500",
         "--nodes", "2", "--no-progress", "--out", str(tmp_path / "m.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the whole group
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (out, err)
    assert "interrupted" in err
    assert "terminate called" not in err
    assert not (tmp_path / "m.json").exists()
