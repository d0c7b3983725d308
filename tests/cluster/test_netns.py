from __future__ import annotations

import subprocess
import sys

import pytest

from plait.cluster import Cluster, NetworkSpec, list_clusters
from plait.cluster.netns import ClusterError, netem_available, teardown_all


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


@pytest.mark.cluster
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


@pytest.mark.cluster
def test_teardown_runs_on_exception() -> None:
    c = Cluster(nodes=2)
    with pytest.raises(RuntimeError, match="boom"), c:
        assert c.netns(0) in _namespaces()
        raise RuntimeError("boom")
    assert c.netns(0) not in _namespaces()


@pytest.mark.cluster
def test_reshape_changes_rate() -> None:
    with Cluster(nodes=2, network=NetworkSpec(bandwidth="100mbit")) as c:
        c.shape(NetworkSpec(bandwidth="1gbit"))
        assert "1Gbit" in _qdisc(c, 0)


@pytest.mark.cluster
@pytest.mark.skipif(not netem_available(), reason="this kernel has no netem qdisc")
def test_delay_and_loss_under_the_rate() -> None:
    with Cluster(nodes=2, network=NetworkSpec(bandwidth="1gbit", latency="1ms", loss=1.0)) as c:
        q = _qdisc(c, 1)
        assert "tbf" in q and "netem" in q and "delay 1ms" in q and "loss 1%" in q


@pytest.mark.cluster
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


@pytest.mark.cluster
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


@pytest.mark.cluster
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


# ------------------------------------------------------------ the link a cluster gets
@pytest.fixture
def no_tc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without shaped namespaces (gVisor, no root)."""
    import plait.cluster.netns as netns

    monkeypatch.setattr(netns, "tc_unavailable", lambda: "no CAP_NET_ADMIN (test)")


def test_without_tc_a_shaped_cluster_gets_a_modelled_link(
    no_tc: None, caplog: pytest.LogCaptureFixture
) -> None:
    c = Cluster.create(nodes=2, network=NetworkSpec(bandwidth="slow"), link="auto")
    assert (c.link, c.emulated) == ("model", False)
    assert "MODELLED link" in caplog.text and "no CAP_NET_ADMIN (test)" in caplog.text
    plain = Cluster.create(nodes=2, link="auto")  # nothing to shape: nothing to model
    assert (plain.link, plain.emulated) == ("none", False)
    with pytest.raises(ValueError, match="link tc: no CAP_NET_ADMIN"):
        Cluster.create(nodes=2, network=NetworkSpec(bandwidth="slow"), link="tc")
    with pytest.raises(ValueError, match="cannot lose packets"):
        Cluster.create(nodes=2, network=NetworkSpec(bandwidth="slow", loss=1.0), link="auto")


def test_the_model_can_be_forced_where_tc_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_LINK", "model")
    c = Cluster.create(nodes=2, network=NetworkSpec(bandwidth="fast"), quiet=True)
    assert (c.link, c.emulated) == ("model", False)
    with c:  # nothing to build: loopback
        assert c.address(1) == "127.0.0.2"
    monkeypatch.setenv("PLAIT_LINK", "wire")
    with pytest.raises(ValueError, match="expected one of auto, tc, model, none"):
        Cluster.create(nodes=2)
