"""`plait plan`: the automatic parallelism planner's choice and table."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from plait._proc import scratch_dir
from plait.cli.common import MAX_NODES, _bandwidths, int_at_least, workload_list, writable_file
from plait.cluster.network import NetworkSpec, resolve_bandwidth
from plait.units import parse_size

#: Where `plait plan --data real` looks for races to rank strategies by time to target.
DEFAULT_RACES = "benchmarks/race"


def add_parser(sub: Any) -> None:
    pl = sub.add_parser("plan", help="the automatic parallelism planner's choice and table")
    pl.add_argument(
        "--workload",
        default="gpt",
        help="a registered workload (mlp, resnet18, vgg, gpt) or a factory "
        "pkg.module:factory / path/to/file.py:factory",
    )
    pl.add_argument("--nodes", type=int, default=4, help="nodes of the cluster to plan for")
    pl.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    pl.add_argument(
        "--memory",
        default=None,
        help="memory per device: 2GiB = 2*2^30 bytes, 2GB = 2*10^9 (default: none)",
    )
    pl.add_argument("--bandwidth", default="fast", help="link rate (tc rate or slow/balanced/fast)")
    pl.add_argument(
        "--probe",
        action="store_true",
        help="measure the network on an emulated cluster instead of the nominal rate",
    )
    pl.add_argument(
        "--data",
        default="synthetic",
        choices=["real", "synthetic"],
        help="synthetic: the benchmark model and batch; real: the training ones",
    )
    pl.add_argument("--batch-size", type=int, default=None, help="per-worker batch size")
    pl.add_argument(
        "--slots",
        type=int,
        default=None,
        help="ranks computing at once (default: this machine's cores, as when "
        "the cluster is emulated here)",
    )
    pl.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    pl.add_argument("--all", action="store_true", help="list every candidate plan")
    pl.add_argument("--json", default=None, help="also write the table as JSON here")
    pl.add_argument(
        "--races",
        default=DEFAULT_RACES,
        help="races (folders of plait race results) whose steps to target rank the "
        "data-parallel strategies and optimizers by time to target (with --data real); "
        "'none' ranks them by projected step time",
    )


def _data_parallel_advice(args: argparse.Namespace, world: int) -> Any:
    """The projection's data-parallel strategy and optimizer for the described cluster
    (`plait.bench.project.recommend`), beside the parallel plan."""
    from plait.bench.project import recommend

    races = []
    if args.races != "none" and Path(args.races).is_dir():
        races = sorted(Path(args.races).glob("*/results.json"))
    return recommend(
        args.workload,
        world=world,
        rate=resolve_bandwidth(args.bandwidth),
        races=races,
        real=args.data == "real",
    )


def _probe_network(args: argparse.Namespace) -> Any:
    from plait.cluster import Cluster, launch
    from plait.comm import CollectiveCosts

    out = scratch_dir("plait-probe-") / "probe.json"
    net = NetworkSpec(bandwidth=args.bandwidth)
    with Cluster.create(nodes=max(2, args.nodes), network=net) as cluster:
        result = launch(
            cluster,
            ["plait.comm.probe", str(out), "--collectives"],
            module=True,
            nproc_per_node=args.nproc_per_node,
            threads=args.threads,
            timeout_s=600,
            quiet=True,
        )
    if not result.ok or not out.exists():
        raise ValueError(f"network probe failed:\n{result.tail()}")
    return CollectiveCosts.from_dict(json.loads(out.read_text())["collectives"])


def validate(args: argparse.Namespace) -> None:
    workload_list(args.workload)
    if "," in args.workload:
        raise ValueError(f"--workload {args.workload!r}: plan takes one workload")
    int_at_least("--nodes", args.nodes, 1, MAX_NODES)
    for flag in ("nproc_per_node", "batch_size", "slots", "threads"):
        int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    if args.memory is not None:
        parse_size(args.memory, what="--memory size")
    args.bandwidth = _bandwidths(args.bandwidth, multi=False)
    writable_file("--json", args.json)
    if args.races not in ("none", DEFAULT_RACES) and not Path(args.races).is_dir():
        raise ValueError(f"--races {args.races!r}: not a folder of race results (or 'none')")


def run(args: argparse.Namespace) -> int:
    from plait.cluster.network import parse_rate, resolve_bandwidth
    from plait.comm import AlphaBeta
    from plait.parallel.memory import parse_bytes
    from plait.parallel.planner import plan_workload

    world = args.nodes * args.nproc_per_node
    if args.probe:
        network = _probe_network(args)
    else:
        network = AlphaBeta.from_rate(parse_rate(resolve_bandwidth(args.bandwidth)))
    choice = plan_workload(
        args.workload,
        world=world,
        network=network,
        memory_bytes=parse_bytes(args.memory) if args.memory else None,
        slots=args.slots or min(world, os.cpu_count() or 1),
        real=args.data == "real",
        batch_size=args.batch_size,
        threads=args.threads,
    )
    print(
        f"plait plan: {args.workload} on {args.nodes} node(s) x {args.nproc_per_node}: "
        f"{choice.plan.describe()}\n\nwhy: {choice.reason}\n"
    )
    print(choice.table(limit=None if args.all else 25))
    advice = _data_parallel_advice(args, world)
    print(f"\n{advice.text()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {**choice.to_dict(), "data_parallel": {"best": advice.best, "rows": advice.rows}}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0
