"""`plait cluster`: emulated clusters that stay up, their status, removal and probe."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, dataclass
from typing import Any, Literal

from plait._proc import scratch_dir
from plait.cli.common import CLUSTER_GROUP, ClusterConfig
from plait.flags import add_options, build, nested, option


@dataclass(frozen=True, kw_only=True)
class ClusterCommandConfig:
    """What `plait cluster` does: the schema of its flags (`plait.flags`).

    Attributes:
        action: up (build one that stays), down (remove clusters), status (list them),
            probe (measure all-reduce on a fresh one).
        all: ``down``: also the clusters of running jobs.
        cluster: the cluster ``up`` builds and ``probe`` measures.
    """

    action: Literal["up", "down", "status", "probe"] = option(
        MISSING,
        "up: build one that stays; down: remove clusters; status: list them; probe: "
        "measure all-reduce on a fresh one",
        positional=True,
    )
    all: bool = option(False, "down: also clusters of running jobs")
    cluster: ClusterConfig = nested(ClusterConfig, group=CLUSTER_GROUP)


def add_parser(sub: Any) -> None:
    c = sub.add_parser("cluster", help="manage emulated clusters")
    add_options(c, ClusterCommandConfig)


def validate(args: argparse.Namespace) -> None:
    args.placement = build(args, ClusterCommandConfig).cluster.placement()


def run(args: argparse.Namespace) -> int:
    return run_config(build(args, ClusterCommandConfig))


def run_config(cfg: ClusterCommandConfig) -> int:
    """Do `cfg.action` on this machine's emulated clusters."""
    from plait.cluster import Cluster, launch, list_clusters, teardown_all

    net = cfg.cluster
    if cfg.action == "status":
        clusters = list_clusters()
        if not clusters:
            print("no plait clusters")
        for c in clusters:
            print(json.dumps(c))
        return 0
    if cfg.action == "down":
        removed = teardown_all(only_dead=not cfg.all)
        print(f"removed {len(removed)} cluster(s): {' '.join(removed) or '-'}")
        return 0
    if cfg.action == "up":
        cluster = Cluster.create(nodes=net.nodes, network=net.network(), persistent=True).up()
        print(f"cluster {cluster.cid}: {net.nodes} node(s), {cluster.network.describe()}")
        for i in range(net.nodes):
            print(
                f"  node {i}: netns {cluster.netns(i)}  {cluster.ifname(i)}  {cluster.address(i)}"
            )
        print("remove with: plait cluster down")
        return 0
    # probe
    nodes = max(2, net.nodes)
    out = scratch_dir("plait-probe-") / "probe.json"
    with Cluster.create(nodes=nodes, network=net.network()) as cluster:
        print(
            f"probing all-reduce on {nodes} node(s) x {net.nproc_per_node}, "
            f"{cluster.network.describe()} ...",
            flush=True,
        )
        result = launch(
            cluster,
            ["plait.comm.probe", str(out)],
            module=True,
            nproc_per_node=net.nproc_per_node,
            threads=net.threads,
            timeout_s=net.timeout or 600,
            quiet=True,
        )
    if not result.ok or not out.exists():
        print(result.tail(), file=sys.stderr)
        return 1
    from plait.comm.probe import format_probe

    print(format_probe(json.loads(out.read_text()), cluster.network.rate_bps))
    return 0
