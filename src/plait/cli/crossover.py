"""`plait crossover run`: co-located jobs that fill each other's communication."""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal

from plait.cli.common import (
    CLUSTER_GROUP,
    MultiRateClusterConfig,
    check_group,
    check_strategies,
    check_token_dir,
    command_line,
    int_at_least,
    trace_path,
    writable_dir,
    writable_file,
)
from plait.flags import add_options, build, nested, option


@dataclass(frozen=True, kw_only=True)
class CrossoverConfig:
    """What `plait crossover run` runs: the schema of its flags (`plait.flags`).

    The constructor checks what the values alone decide (ValueError naming the flag);
    `validate` checks the rest against this machine (the files, the token's folder, the
    jobs' scripts and strategies).

    Attributes:
        jobs: the co-located jobs: WORKLOAD/STRATEGY, a JSON file of train settings, or a
            quoted command.
        cluster: the emulated cluster they share (one run per ``--bandwidth`` rate).
        steps: steps per built-in job.
        warmup: steps excluded from rates.
        repeats: interleaved repeats of `compare`.
        group: the compute token's group name, None for one per cluster.
        mode: without `compare`: the jobs gated by the token, or not.
        compare: measure alone (sequential), uncoordinated and crossover.
        trace: the merged timeline of the co-located jobs, None for none.
        out: output directory (results.json/.md/.png), None for none.
    """

    jobs: tuple[str, ...] = option(
        MISSING,
        "jobs: workload/strategy (resnet18/ssgd), a JSON file of train settings, or a "
        "quoted command (its script gets PLAIT_CROSSOVER_GROUP)",
        positional=True,
    )
    cluster: MultiRateClusterConfig = nested(MultiRateClusterConfig, group=CLUSTER_GROUP)
    steps: int = option(20, "steps per built-in job")
    warmup: int = option(3, "steps excluded from rates")
    repeats: int = option(1, "--compare: interleaved repeats")
    group: str | None = option(None, "token group name (default: per cluster)")
    mode: Literal["crossover", "uncoordinated"] = option(
        "crossover", "without --compare: run the jobs gated by the token, or not"
    )
    compare: bool = option(False, "measure alone (sequential), uncoordinated and crossover")
    trace: str | None = option(None, "merged timeline of the co-located jobs")
    out: str | None = option(None, "output directory (results.json/.md/.png)")

    def __post_init__(self) -> None:
        int_at_least("--steps", self.steps, 1)
        int_at_least("--warmup", self.warmup, 0)
        int_at_least("--repeats", self.repeats, 1)
        if self.compare and self.warmup + 2 > self.steps:
            raise ValueError(
                f"--warmup {self.warmup} with --steps {self.steps}: --compare needs "
                "--steps >= --warmup + 2 (two steps after warm-up to measure a rate)"
            )
        check_group("--group", self.group)
        if len(self.jobs) < 2:
            raise ValueError(f"{len(self.jobs)} job(s) given; crossover runs at least two")


def add_parser(sub: Any) -> None:
    x = sub.add_parser("crossover", help="co-located jobs that fill each other's communication")
    xs = x.add_subparsers(dest="action", required=True)
    xr = xs.add_parser("run", help="launch co-located jobs on one emulated cluster")
    add_options(xr, CrossoverConfig)


def validate(args: argparse.Namespace) -> None:
    from plait.bench.colocate import Job
    from plait.train.config import TrainConfig

    cfg = build(args, CrossoverConfig)
    args.placement = cfg.cluster.placement()  # the jobs' backend, checked below
    check_token_dir("plait crossover run")
    writable_file("--trace", cfg.trace)
    writable_dir("--out", cfg.out)
    world = cfg.cluster.world
    for i, spec in enumerate(cfg.jobs):
        job = Job.parse(spec, i)
        if job.config is not None:
            try:
                train = TrainConfig(**job.config)
                check_strategies([train.strategy_spec()], [train.workload], world, args)
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
    return run_config(build(args, CrossoverConfig))


def run_config(cfg: CrossoverConfig) -> int:
    """Run the co-located jobs `cfg` describes, once per ``--bandwidth`` rate."""
    from plait.bench.colocate import Job, Mode, compare, run_colocated
    from plait.bench.crossover_report import markdown, write
    from plait.cluster import Cluster

    for i, spec in enumerate(cfg.jobs):
        Job.parse(spec, i)  # bad job specs fail before any cluster is built
    cluster_cfg = cfg.cluster
    bandwidths = cluster_cfg.bandwidths()
    nets = [cluster_cfg.network(b) for b in bandwidths]
    records = []
    with Cluster.create(nodes=cluster_cfg.nodes, network=nets[0]) as cluster:
        for bandwidth, net in zip(bandwidths, nets, strict=True):
            cluster.shape(net)
            trace = trace_path(cfg.trace, bandwidth if len(nets) > 1 else None)
            print(
                f"plait crossover: {len(cfg.jobs)} jobs on {cluster_cfg.nodes} node(s), "
                f"{net.describe()}",
                flush=True,
            )
            if not cfg.compare:
                runs = run_colocated(
                    cluster,
                    list(cfg.jobs),
                    mode=Mode(cfg.mode),
                    steps=cfg.steps,
                    group=cfg.group,
                    nproc_per_node=cluster_cfg.nproc_per_node,
                    threads=cluster_cfg.threads,
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
                list(cfg.jobs),
                steps=cfg.steps,
                warmup=cfg.warmup,
                repeats=cfg.repeats,
                group=cfg.group,
                nproc_per_node=cluster_cfg.nproc_per_node,
                threads=cluster_cfg.threads,
                trace=trace,
            )
            records.append(comp.to_dict())
            print(markdown(records[-1:]), flush=True)
            if cfg.out:
                write(records, Path(cfg.out), command=command_line())
    if records:
        print(markdown(records))
    return 0
