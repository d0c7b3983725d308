"""`plait plan`: the automatic parallelism planner's choice and table."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from plait._proc import scratch_dir
from plait.cli.common import MAX_NODES, _bandwidths, int_at_least, workload_list, writable_file
from plait.cluster.network import NetworkSpec, resolve_bandwidth
from plait.flags import add_options, option
from plait.units import parse_size

#: Where `plait plan --data real` looks for races to rank strategies by time to target.
DEFAULT_RACES = "benchmarks/race"


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """What `plait plan` plans for: the schema of its flags (`plait.flags`).

    Attributes:
        workload: the workload planned (one).
        nodes: nodes of the cluster.
        nproc_per_node: ranks per node.
        memory: memory per device (a size), None for unlimited.
        bandwidth: the link rate priced, or probed with `probe`.
        probe: measure the network on an emulated cluster instead of the nominal rate.
        data: ``synthetic`` prices the benchmark model and batch, ``real`` the training
            ones.
        batch_size: per-worker batch (default: the workload's).
        slots: ranks computing at once (default: this machine's cores).
        threads: intra-op threads per rank.
        all: list every candidate plan, not the first 25.
        json: also write the table as JSON here.
        races: folders of race results that rank the data-parallel strategies.
    """

    workload: str = option(
        "gpt",
        "a registered workload (mlp, resnet18, vgg, gpt) or a factory "
        "pkg.module:factory / path/to/file.py:factory",
    )
    nodes: int = option(4, "nodes of the cluster to plan for")
    nproc_per_node: int = option(1, "ranks per node")
    memory: str | None = option(
        None, "memory per device: 2GiB = 2*2^30 bytes, 2GB = 2*10^9 (default: none)"
    )
    bandwidth: str = option("fast", "link rate (tc rate or slow/balanced/fast)")
    probe: bool = option(
        False, "measure the network on an emulated cluster instead of the nominal rate"
    )
    data: Literal["real", "synthetic"] = option(
        "synthetic", "synthetic: the benchmark model and batch; real: the training ones"
    )
    batch_size: int | None = option(None, "per-worker batch size")
    slots: int | None = option(
        None,
        "ranks computing at once (default: this machine's cores, as when "
        "the cluster is emulated here)",
    )
    threads: int = option(1, "intra-op threads per rank")
    all: bool = option(False, "list every candidate plan")
    json: str | None = option(None, "also write the table as JSON here")
    races: str = option(
        DEFAULT_RACES,
        "races (folders of plait race results) whose steps to target rank the "
        "data-parallel strategies and optimizers by time to target (with --data real); "
        "'none' ranks them by projected step time",
    )


def add_parser(sub: Any) -> None:
    pl = sub.add_parser("plan", help="the automatic parallelism planner's choice and table")
    add_options(pl, PlanConfig)


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
