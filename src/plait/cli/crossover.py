"""`plait crossover run`: co-located jobs that fill each other's communication."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from plait.cli.common import (
    add_cluster_args,
    check_cluster_args,
    check_group,
    check_strategies,
    check_token_dir,
    command_line,
    int_at_least,
    network_spec,
    trace_path,
    writable_dir,
    writable_file,
)


def add_parser(sub: Any) -> None:
    x = sub.add_parser("crossover", help="co-located jobs that fill each other's communication")
    xs = x.add_subparsers(dest="action", required=True)
    xr = xs.add_parser("run", help="launch co-located jobs on one emulated cluster")
    xr.add_argument(
        "jobs",
        nargs="+",
        help="jobs: workload/strategy (resnet18/ssgd), a JSON file of train settings, or a "
        "quoted command (its script gets PLAIT_CROSSOVER_GROUP)",
    )
    add_cluster_args(xr, multi_bandwidth=True)
    xr.add_argument("--steps", type=int, default=20, help="steps per built-in job")
    xr.add_argument("--warmup", type=int, default=3, help="steps excluded from rates")
    xr.add_argument("--repeats", type=int, default=1, help="--compare: interleaved repeats")
    xr.add_argument("--group", default=None, help="token group name (default: per cluster)")
    xr.add_argument(
        "--mode",
        default="crossover",
        choices=["crossover", "uncoordinated"],
        help="without --compare: run the jobs gated by the token, or not",
    )
    xr.add_argument(
        "--compare",
        action="store_true",
        help="measure alone (sequential), uncoordinated and crossover",
    )
    xr.add_argument("--trace", default=None, help="merged timeline of the co-located jobs")
    xr.add_argument("--out", default=None, help="output directory (results.json/.md/.png)")


def validate(args: argparse.Namespace) -> None:
    from plait.bench.colocate import Job
    from plait.train.config import TrainConfig

    check_cluster_args(args, multi_bandwidth=True)
    int_at_least("--steps", args.steps, 1)
    int_at_least("--warmup", args.warmup, 0)
    int_at_least("--repeats", args.repeats, 1)
    if args.compare and args.warmup + 2 > args.steps:
        raise ValueError(
            f"--warmup {args.warmup} with --steps {args.steps}: --compare needs "
            "--steps >= --warmup + 2 (two steps after warm-up to measure a rate)"
        )
    check_group("--group", args.group)
    check_token_dir("plait crossover run")
    writable_file("--trace", args.trace)
    writable_dir("--out", args.out)
    if len(args.jobs) < 2:
        raise ValueError(f"{len(args.jobs)} job(s) given; crossover runs at least two")
    for i, spec in enumerate(args.jobs):
        job = Job.parse(spec, i)
        world = args.nodes * args.nproc_per_node
        if job.config is not None:
            try:
                cfg = TrainConfig(**job.config)
                check_strategies([cfg.strategy_spec()], [cfg.workload], world, args)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"job {spec!r}: {exc}") from None
        elif job.workload is not None and job.strategy is not None:
            check_strategies([job.strategy], [job.workload], world, args)  # plans, backend
        elif job.command and not Path(job.command[0]).is_file():
            raise ValueError(
                f"job {spec!r}: no such script {job.command[0]!r} (expected WORKLOAD/STRATEGY, "
                "a JSON file of train settings, or a quoted command whose first word is a script)"
            )


def run(args: argparse.Namespace) -> int:
    from plait.bench.colocate import Job, Mode, compare, run_colocated
    from plait.bench.crossover_report import markdown, write
    from plait.cluster import Cluster

    for i, spec in enumerate(args.jobs):
        Job.parse(spec, i)  # bad job specs fail before any cluster is built
    if len(args.jobs) < 2:
        raise ValueError("plait crossover run: give at least two jobs")
    bandwidths = [b.strip() for b in args.bandwidth.split(",")] if args.bandwidth else [None]
    nets = [network_spec(args, b) for b in bandwidths]
    records = []
    with Cluster.create(nodes=args.nodes, network=nets[0]) as cluster:
        for bandwidth, net in zip(bandwidths, nets, strict=True):
            cluster.shape(net)
            trace = trace_path(args.trace, bandwidth if len(nets) > 1 else None)
            print(
                f"plait crossover: {len(args.jobs)} jobs on {args.nodes} node(s), {net.describe()}",
                flush=True,
            )
            if not args.compare:
                runs = run_colocated(
                    cluster,
                    args.jobs,
                    mode=Mode(args.mode),
                    steps=args.steps,
                    group=args.group,
                    nproc_per_node=args.nproc_per_node,
                    threads=args.threads,
                    trace=trace,
                )
                total = 0.0
                for r in runs:
                    if not r.ok:
                        print(r.log, file=sys.stderr)
                        raise RuntimeError(f"{r.job} failed")
                    t = r.step_end_unix
                    rate = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else 0.0
                    total += rate * r.samples_per_step
                    print(
                        f"  {r.job}: {rate:.2f} steps/s, {rate * r.samples_per_step:.1f} "
                        f"samples/s, token {r.token}"
                    )
                print(f"  aggregate: {total:.1f} samples/s")
                continue
            comp = compare(
                cluster,
                args.jobs,
                steps=args.steps,
                warmup=args.warmup,
                repeats=args.repeats,
                group=args.group,
                nproc_per_node=args.nproc_per_node,
                threads=args.threads,
                trace=trace,
            )
            records.append(comp.to_dict())
            print(markdown(records[-1:]), flush=True)
            if args.out:
                write(records, Path(args.out), command=command_line())
    if records:
        print(markdown(records))
    return 0
