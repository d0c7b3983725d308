from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from plait.cluster import Cluster, NetworkSpec, launch
from tests.conftest import NET_ADMIN

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
