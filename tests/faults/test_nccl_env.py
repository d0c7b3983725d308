"""NCCL on the emulated cluster takes the node's shaped link, like gloo.

The emulated nodes share one host, so without these settings NCCL would move data over
shared memory or peer-to-peer GPU paths between them, around the link being measured.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from plait.cluster import Cluster, launch
from plait.cluster.launch import worker_env

TRANSPORTS_OFF = ("NCCL_SHM_DISABLE", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE")


@pytest.mark.parametrize("emulated", [True, False])
def test_every_node_pins_nccl_to_its_link(emulated: bool) -> None:
    c = Cluster(nodes=3, emulated=emulated)
    for node in range(3):
        env = worker_env(c, node, threads=1)
        assert env["NCCL_SOCKET_IFNAME"] == c.ifname(node) == env["GLOO_SOCKET_IFNAME"]
        assert all(env[k] == "1" for k in TRANSPORTS_OFF)
    assert worker_env(c, 1, threads=1)["NCCL_SOCKET_IFNAME"] == (
        f"plv{c.cid}n1" if emulated else "lo"
    )


def test_user_environment_cannot_reopen_the_bypass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    c = Cluster(nodes=2)
    env = worker_env(c, 0, threads=1)
    assert env["NCCL_P2P_DISABLE"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == c.ifname(0)


NCCL_JOB = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    # every emulated node runs LOCAL_RANK 0: spread the nodes over the GPUs by global rank
    # (NCCL refuses two ranks of one communicator on one device)
    torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())
    dist.init_process_group("nccl")
    x = torch.ones(1 << 16, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(x)
    keys = ["NCCL_SOCKET_IFNAME", "NCCL_SHM_DISABLE", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"]
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"sum": x[0].item(), "env": {k: os.environ.get(k) for k in keys}}, f)
    dist.destroy_process_group()
    """
)


@pytest.mark.gpu
@pytest.mark.cluster
def test_nccl_all_reduce_across_emulated_nodes(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("two emulated nodes need a GPU each (NCCL refuses two ranks on one device)")
    script = tmp_path / "nccl_job.py"
    script.write_text(NCCL_JOB)
    with Cluster.create(nodes=2, quiet=True) as c:
        res = launch(c, [str(script), str(tmp_path)], timeout_s=120, quiet=True)
    assert res.ok, res.tail()
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["sum"] == 3.0
        assert out["env"]["NCCL_SOCKET_IFNAME"] == c.ifname(rank)
        assert all(out["env"][k] == "1" for k in TRANSPORTS_OFF)
