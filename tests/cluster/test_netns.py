from __future__ import annotations

import subprocess
import sys

import pytest

from plait.cluster import Cluster, NetworkSpec, list_clusters
from plait.cluster.netns import ClusterError, netem_available, teardown_all

pytestmark = pytest.mark.cluster


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _qdisc(cluster: Cluster, node: int) -> str:
    return subprocess.run(
        [*cluster.exec_prefix(node), "tc", "qdisc", "show", "dev", cluster.ifname(node)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_two_clusters_coexist_and_tear_down() -> None:
    a = Cluster(nodes=2, network=NetworkSpec(bandwidth="50mbit"))
    b = Cluster(nodes=3, network=NetworkSpec(bandwidth="200mbit"))
    with a, b:
        assert a.cid != b.cid and a.bridge != b.bridge
        names = _namespaces()
        assert {a.netns(0), a.netns(1), b.netns(0), b.netns(1), b.netns(2)} <= names
        assert "tbf" in _qdisc(a, 1) and "50Mbit" in _qdisc(a, 1)
        assert "200Mbit" in _qdisc(b, 2)
        ids = {c["cid"] for c in list_clusters()}
        assert {a.cid, b.cid} <= ids
    names = _namespaces()
    assert not any(n.startswith(f"plait-{a.cid}") or n.startswith(f"plait-{b.cid}") for n in names)


def test_teardown_runs_on_exception() -> None:
    c = Cluster(nodes=2)
    with pytest.raises(RuntimeError, match="boom"), c:
        assert c.netns(0) in _namespaces()
        raise RuntimeError("boom")
    assert c.netns(0) not in _namespaces()


def test_reshape_changes_rate() -> None:
    with Cluster(nodes=2, network=NetworkSpec(bandwidth="100mbit")) as c:
        c.shape(NetworkSpec(bandwidth="1gbit"))
        assert "1Gbit" in _qdisc(c, 0)


@pytest.mark.skipif(not netem_available(), reason="this kernel has no netem qdisc")
def test_delay_and_loss_under_the_rate() -> None:
    with Cluster(nodes=2, network=NetworkSpec(bandwidth="1gbit", latency="1ms", loss=1.0)) as c:
        q = _qdisc(c, 1)
        assert "tbf" in q and "netem" in q and "delay 1ms" in q and "loss 1%" in q


@pytest.mark.skipif(netem_available(), reason="this kernel has netem")
def test_delay_without_netem_is_a_clear_error() -> None:
    c = Cluster(nodes=1, network=NetworkSpec(latency="1ms"))
    with pytest.raises(ClusterError, match="netem"), c:
        pass
    assert c.netns(0) not in _namespaces()


CRASH = """
import os, sys
from plait.cluster import Cluster
c = Cluster(nodes=2).up()
print(c.cid, flush=True)
os.kill(os.getpid(), 9)  # a crash: no teardown runs
"""


def test_down_removes_leftovers_of_a_crash_only() -> None:
    with Cluster(nodes=1) as alive:  # owned by this live process: must survive
        proc = subprocess.run(
            [sys.executable, "-c", CRASH], capture_output=True, text=True, check=False
        )
        assert proc.returncode == -9
        dead = proc.stdout.strip()
        assert f"plait-{dead}-1" in _namespaces()
        removed = teardown_all()
        assert dead in removed and alive.cid not in removed
        assert f"plait-{dead}-1" not in _namespaces()
        assert alive.netns(0) in _namespaces()


def test_invalid_node_count() -> None:
    with pytest.raises(ValueError, match="nodes"):
        Cluster(nodes=0)


def test_down_spares_a_cluster_without_state_whose_job_runs() -> None:
    """Its state file in another PLAIT_STATE_DIR (here: removed): `cluster down` used to
    list it as a dead leftover and remove it under the running job."""
    from plait.cluster.netns import STATE_DIR, teardown

    c = Cluster(nodes=1, persistent=True).up()  # a state file without an owner pid
    try:
        (STATE_DIR / f"{c.cid}.json").unlink()
        job = subprocess.Popen([*c.exec_prefix(0), "sleep", "60"])
        try:
            state = next(s for s in list_clusters() if s["cid"] == c.cid)
            assert state["leftover"] and state["alive"]
            assert c.cid not in teardown_all()
            assert c.netns(0) in _namespaces()
        finally:
            job.kill()
            job.wait()
        assert c.cid in teardown_all()  # nothing runs in it any more: a true leftover
        assert c.netns(0) not in _namespaces()
    finally:
        teardown(c.cid)
