from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from plait._proc import PARENT_ENV
from plait.cluster import Cluster, LaunchResult, NetworkSpec, launch
from plait.cluster.launch import torchrun_argv, worker_env
from plait.cluster.netns import LOOPBACK_ENV
from tests.conftest import NET_ADMIN

#: the module itself: `plait.cluster.launch` as an attribute is the function `launch`
launch_mod = importlib.import_module("plait.cluster.launch")

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    out = sys.argv[1]
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        f.write(f"{x.item()} {os.environ.get('GLOO_SOCKET_IFNAME')} {os.environ['PLAIT_NODE']}")
    if len(sys.argv) > 2 and dist.get_rank() == int(sys.argv[2]):
        sys.exit(3)
    dist.destroy_process_group()
    """
)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def test_launch_runs_every_rank(tmp_path: Path) -> None:
    with Cluster.create(nodes=2, network=NetworkSpec(bandwidth="1gbit"), quiet=True) as c:
        res = launch(
            c,
            [str(_script(tmp_path)), str(tmp_path / "out")],
            nproc_per_node=2,
            timeout_s=120,
            quiet=True,
        )
    assert res.ok, res.tail()
    rows = [(tmp_path / f"out.{r}").read_text().split() for r in range(4)]
    assert all(float(v) == 10.0 for v, _, _ in rows)  # 1 + 2 + 3 + 4
    assert [node for *_, node in rows] == ["0", "0", "1", "1"]  # rank 0 lives on node 0
    if NET_ADMIN:
        assert rows[2][1] == c.ifname(1)


def test_launch_reports_failure(tmp_path: Path) -> None:
    with Cluster.create(nodes=2, quiet=True) as c:
        res = launch(
            c, [str(_script(tmp_path)), str(tmp_path / "out"), "1"], timeout_s=120, quiet=True,
            log_dir=tmp_path / "logs",
        )  # fmt: skip
    assert not res.ok
    assert res.returncodes[1] != 0


def test_launch_timeout_kills_job(tmp_path: Path) -> None:
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(600)\n")
    with Cluster.create(nodes=2, quiet=True) as c:
        res = launch(c, [str(hang)], timeout_s=3, quiet=True, log_dir=tmp_path / "logs")
    assert res.timed_out and not res.ok
    assert res.elapsed_s < 60


def test_launch_rejects_bad_input(tmp_path: Path) -> None:
    with Cluster.create(nodes=1, quiet=True) as c:
        with pytest.raises(ValueError, match="nproc_per_node"):
            launch(c, [sys.executable], nproc_per_node=0)
        with pytest.raises(ValueError, match="nothing to run"):
            launch(c, [])


# ------------------------------------------------------------ without a cluster
def test_worker_env_pins_every_transport_to_the_node_link() -> None:
    c = Cluster(nodes=3, network=NetworkSpec(bandwidth="1gbit"), cid="abc123")
    env = worker_env(c, 2, threads=3, extra={"OMP_NUM_THREADS": "5", "MINE": "x"})
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "plvabc123n2"
    assert env["NCCL_SHM_DISABLE"] == env["NCCL_P2P_DISABLE"] == env["NCCL_IB_DISABLE"] == "1"
    assert (env["PLAIT_NODES"], env["PLAIT_NODE"], env["PLAIT_CLUSTER"]) == ("3", "2", "abc123")
    assert env["PLAIT_BANDWIDTH"] == "1gbit" and env["PLAIT_EMULATED"] == "1"
    assert env[PARENT_ENV] == str(os.getpid()) and env[LOOPBACK_ENV] == "0"
    assert env["OMP_NUM_THREADS"] == "5" and env["MINE"] == "x"  # extra wins
    assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is inherited
    loop = worker_env(Cluster(nodes=2, emulated=False), 1, threads=2)
    assert loop["GLOO_SOCKET_IFNAME"] == "lo" and loop[LOOPBACK_ENV] == "1"
    assert loop["OMP_NUM_THREADS"] == "2" and loop["PLAIT_EMULATED"] == "0"
    assert env["PLAIT_LINK"] == "tc" and loop["PLAIT_LINK"] == "none"


def test_worker_env_of_a_modelled_link_names_rate_and_delay() -> None:
    net = NetworkSpec(bandwidth="slow", latency="2ms")
    c = Cluster(nodes=2, network=net, emulated=False, link="model")
    env = worker_env(c, 0, threads=1, extra=None)
    assert (env["PLAIT_LINK"], env["PLAIT_RATE"], env["PLAIT_LATENCY"]) == (
        "model", "100mbit", "2ms"
    )  # fmt: skip
    from plait.comm import link

    os_env = dict(os.environ)
    try:
        os.environ.update({k: env[k] for k in ("PLAIT_LINK", "PLAIT_RATE", "PLAIT_LATENCY")})
        model = link.from_env()
    finally:
        os.environ.clear()
        os.environ.update(os_env)
    assert model is not None and model.model.bandwidth_bps == pytest.approx(1e8 / link.FRAMING)


def _flags(cmd: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)


def test_torchrun_argv_joins_one_rendezvous_hosted_by_node_0() -> None:
    c = Cluster(nodes=2, cid="0a0b0c")
    cmds = [
        torchrun_argv(
            c, n, ["train.py", "--lr=1"], nproc_per_node=4, port=2900, max_restarts=2, module=False
        )
        for n in range(2)
    ]
    for node, cmd in enumerate(cmds):
        assert cmd[:4] == ["ip", "netns", "exec", c.netns(node)]
        assert cmd[4:7] == [sys.executable, "-m", "plait.cluster.agent"]
        assert cmd[-2:] == ["train.py", "--lr=1"]  # the job's own flags come last
        flags = _flags(cmd[:-2])
        assert flags["nnodes"] == "2" and flags["nproc-per-node"] == "4"
        assert flags["rdzv-endpoint"] == f"{c.address(0)}:2900"
        assert flags["rdzv-id"] == "0a0b0c-2900" and flags["max-restarts"] == "2"
        assert flags["local-addr"] == c.address(node)
        assert flags["rdzv-conf"].startswith(f"is_host={int(node == 0)},")
    loop = Cluster(nodes=2, emulated=False)
    cmd = torchrun_argv(
        loop,
        1,
        ["plait.train"],
        nproc_per_node=1,
        port=1,
        max_restarts=0,
        module=True,
        run_id="job",
    )
    assert cmd[0] == sys.executable and cmd[-2:] == ["-m", "plait.train"]
    assert _flags(cmd)["rdzv-id"] == "job" and _flags(cmd)["local-addr"] == "127.0.0.2"


def test_launch_result_and_log_tails(tmp_path: Path) -> None:
    log = tmp_path / "node1.log"
    log.write_text("\n".join(f"line {i}" for i in range(50)))
    res = LaunchResult(returncodes=[0, 1], log_dir=tmp_path, elapsed_s=1.0, logs={1: log})
    assert not res.ok
    tail = res.tail(lines=3)
    assert tail.splitlines() == [f"--- node 1 ({log}) ---", "line 47", "line 48", "line 49"]
    assert LaunchResult(returncodes=[0, 0], log_dir=tmp_path, elapsed_s=1.0).ok
    assert not LaunchResult(returncodes=[0], log_dir=tmp_path, elapsed_s=1.0, timed_out=True).ok


def test_a_failed_node_stops_the_others_after_a_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_mod, "_FAIL_GRACE_S", 0.3)
    procs = [subprocess.Popen(["sleep", "60"], start_new_session=True), subprocess.Popen(["false"])]
    start = time.monotonic()
    assert launch_mod._wait_all(procs, None, None) == (False, [])  # not a timeout, none hung
    assert time.monotonic() - start < 10
    assert procs[0].poll() is None  # still running: stopping it is _kill_all's work
    launch_mod._kill_all(procs)
    assert procs[0].returncode == -signal.SIGTERM


def test_a_deadline_or_a_stop_ends_the_wait() -> None:
    procs = [subprocess.Popen(["sleep", "60"], start_new_session=True)]
    try:
        assert launch_mod._wait_all(procs, time.monotonic() + 0.2, None) == (True, [])
        stop = threading.Event()
        stop.set()
        assert launch_mod._wait_all(procs, None, stop) == (False, [])
    finally:
        launch_mod._kill_all(procs)
    assert procs[0].returncode is not None


def test_a_node_hung_after_its_peers_finished_is_stopped_and_reported(tmp_path: Path) -> None:
    """A worker that never exits (as a gloo teardown deadlock at interpreter exit does)
    while the other node's workers succeeded: torchrun's exit barrier would wait 300 s and
    call the job done; the launcher stops it after the grace and keeps its log."""
    job = tmp_path / "job.py"
    job.write_text(
        textwrap.dedent(
            """
            import os, time
            if os.environ["PLAIT_NODE"] == "1":
                print("node 1 finished its work, then hangs", flush=True)
                time.sleep(600)
            """
        )
    )
    with Cluster.create(nodes=2, quiet=True) as c:
        res = launch(c, [str(job)], timeout_s=120, quiet=True, exit_grace_s=3.0)
    assert res.hung == [1] and not res.ok and not res.timed_out
    assert res.returncodes[0] == 0  # node 0's workers succeeded before it was stopped
    assert res.elapsed_s < 60
    assert "node 1 was still running" in res.describe_failure()
    assert "hangs" in res.logs[1].read_text()  # the log is kept for the report
    # torchrun's own log folders live inside the job's, not as /tmp/torchelastic_*
    assert (res.log_dir / "torchelastic-node1").is_dir()


def test_a_stopped_launch_keeps_its_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait import _proc

    def interrupted(*args: object, **kwargs: object) -> tuple[bool, list[int]]:
        raise KeyboardInterrupt

    monkeypatch.setattr(launch_mod, "_wait_all", interrupted)
    before = set(_proc._SCRATCH)
    with Cluster.create(nodes=2, quiet=True) as c, pytest.raises(KeyboardInterrupt):
        launch(c, ["-c", "pass"], module=False, quiet=True)
    created = [p for p in Path(os.environ.get("TMPDIR", "/tmp")).glob(f"plait-{c.cid}-*")]
    assert created, "the launch made its log folder"
    # kept: no longer removed at exit (it holds the logs of where the job was stopped)
    assert not any(p in _proc._SCRATCH for p in created)
    assert before >= set(_proc._SCRATCH) - set(created)


def test_an_error_every_restart_would_repeat_stops_the_job_at_once(tmp_path: Path) -> None:
    """A full disk or a refused checkpoint used to fail every restart alike."""
    job = tmp_path / "job.py"
    job.write_text(
        textwrap.dedent(
            f"""
            import os, sys, time
            from plait.cluster.agent import report_fatal
            with open({str(tmp_path / "attempts")!r}, "a") as f:
                f.write(os.environ["PLAIT_NODE"])
            if os.environ["PLAIT_NODE"] == "1":
                report_fatal("CheckpointError: the disk is full (ENOSPC)")
                sys.exit(1)
            time.sleep(600)
            """
        )
    )
    with Cluster.create(nodes=2, quiet=True) as c:
        res = launch(c, [str(job)], timeout_s=120, max_restarts=3, quiet=True)
    assert not res.ok and "the disk is full" in res.fatal
    assert "without restarting" in res.describe_failure()
    assert (tmp_path / "attempts").read_text().count("1") == 1  # no restart was tried
