"""A killed worker on a 4-node emulated cluster: every node restarts and the job resumes.

Each node's torchrun used to restart on its own against a fixed address, and the nodes'
attempts never met again (gloo's full mesh failed at every try); the nodes now share one
c10d rendezvous and re-form the group together.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from plait.cluster import Cluster, launch

pytestmark = pytest.mark.cluster

SCRIPT = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch, torch.distributed as dist

    out, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(out, "ckpt")  # rank 0's: one step for all ranks
    start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
    with open(os.path.join(out, f"starts.{rank}"), "a") as f:
        f.write(f"{start}\\n")
    total = torch.zeros(1)
    for step in range(start, steps):
        x = torch.ones(1)
        dist.all_reduce(x)
        assert x.item() == world
        if rank == 2 and step == 3 and not os.path.exists(os.path.join(out, "killed")):
            open(os.path.join(out, "killed"), "w").close()
            os._exit(1)
        if rank == 0:
            with open(ckpt + ".tmp", "w") as f:
                f.write(str(step + 1))
            os.replace(ckpt + ".tmp", ckpt)
        time.sleep(0.05)
    dist.barrier()
    with open(os.path.join(out, f"done.{rank}"), "w") as f:
        f.write(str(steps))
    dist.destroy_process_group()
    """
)


def test_four_nodes_restart_together_and_resume(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    steps = 8
    with Cluster.create(nodes=4, quiet=True) as cluster:
        res = launch(
            cluster,
            [str(script), str(tmp_path), str(steps)],
            max_restarts=2,
            timeout_s=90,
            quiet=True,
        )
    assert res.ok, res.tail()
    assert (tmp_path / "killed").exists()
    assert all((tmp_path / f"done.{r}").read_text() == str(steps) for r in range(4))
    for r in range(4):
        starts = [int(s) for s in (tmp_path / f"starts.{r}").read_text().split()]
        assert starts[0] == 0 and len(starts) == 2, starts  # one restart, on every node
        assert 3 <= starts[1] < steps, starts  # resumed from the checkpoint
    assert res.elapsed_s < 60


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
