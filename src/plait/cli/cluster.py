"""`plait cluster`: emulated clusters that stay up, their status, removal and probe."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from plait._proc import scratch_dir
from plait.cli.common import add_cluster_args, check_cluster_args, network_spec


def add_parser(sub: Any) -> None:
    c = sub.add_parser("cluster", help="manage emulated clusters")
    c.add_argument(
        "action",
        choices=["up", "down", "status", "probe"],
        help="up: build one that stays; down: remove clusters; status: list them; probe: "
        "measure all-reduce on a fresh one",
    )
    c.add_argument("--all", action="store_true", help="down: also clusters of running jobs")
    add_cluster_args(c)


def validate(args: argparse.Namespace) -> None:
    check_cluster_args(args)


def run(args: argparse.Namespace) -> int:
    from plait.cluster import Cluster, launch, list_clusters, teardown_all

    if args.action == "status":
        clusters = list_clusters()
        if not clusters:
            print("no plait clusters")
        for c in clusters:
            print(json.dumps(c))
        return 0
    if args.action == "down":
        removed = teardown_all(only_dead=not args.all)
        print(f"removed {len(removed)} cluster(s): {' '.join(removed) or '-'}")
        return 0
    if args.action == "up":
        cluster = Cluster.create(nodes=args.nodes, network=network_spec(args), persistent=True).up()
        print(f"cluster {cluster.cid}: {args.nodes} node(s), {cluster.network.describe()}")
        for i in range(args.nodes):
            print(
                f"  node {i}: netns {cluster.netns(i)}  {cluster.ifname(i)}  {cluster.address(i)}"
            )
        print("remove with: plait cluster down")
        return 0
    # probe
    nodes = max(2, args.nodes)
    out = scratch_dir("plait-probe-") / "probe.json"
    with Cluster.create(nodes=nodes, network=network_spec(args)) as cluster:
        print(
            f"probing all-reduce on {nodes} node(s) x {args.nproc_per_node}, "
            f"{cluster.network.describe()} ...",
            flush=True,
        )
        result = launch(
            cluster,
            ["plait.comm.probe", str(out)],
            module=True,
            nproc_per_node=args.nproc_per_node,
            threads=args.threads,
            timeout_s=args.timeout or 600,
            quiet=True,
        )
    if not result.ok or not out.exists():
        print(result.tail(), file=sys.stderr)
        return 1
    from plait.comm.probe import format_probe

    print(format_probe(json.loads(out.read_text()), cluster.network.rate_bps))
    return 0
