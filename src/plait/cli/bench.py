"""`plait bench`: strategies side by side on one cluster, or a benchmark suite by name.

``plait bench [flags]`` compares data-parallel strategies on an emulated cluster (the
flags below). ``plait bench SUITE [flags]`` runs one of the suites of
`plait.bench.suites` instead, with the suite's own flags: `split_suite` finds the suite's
name before argparse sees the command line, since the suites' flags are not
``plait bench``'s and each suite parses its own (`plait.flags`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.bench.suites import SUITES
from plait.cli.common import (
    CLUSTER_GROUP,
    ListingFormatter,
    MultiRateClusterConfig,
    add_config_arg,
    check_strategies,
    check_tensorboard_dir,
    int_at_least,
    workload_list,
    writable_dir,
)
from plait.flags import add_options, build, nested, option
from plait.specs import split_specs


def split_suite(argv: Sequence[str]) -> tuple[list[str], str, list[str]] | None:
    """``plait``'s own flags and ``bench``, the suite's name and its arguments, when
    `argv` (``plait``'s arguments) runs a suite; None otherwise.

    ``plait``'s flags before the command take no value, so the first argument that is not
    a flag is the command; ``plait bench`` itself takes no positional argument, so one
    right after it names a suite.

    Raises:
        ValueError: the argument after ``bench`` names no suite.
    """
    for i, arg in enumerate(argv):
        if arg.startswith("-"):
            continue
        if arg != "bench" or i + 1 == len(argv) or argv[i + 1].startswith("-"):
            return None
        name = argv[i + 1]
        if name not in SUITES:
            raise ValueError(f"no suite {name!r}; the suites: {', '.join(SUITES)}")
        return list(argv[: i + 1]), name, list(argv[i + 2 :])
    return None


def run_suite(name: str, argv: Sequence[str]) -> int:
    """Run the suite `name` on its arguments `argv` (``plait bench NAME ARGV...``)."""
    from plait.bench.suites import main

    return main(name, argv, prog=f"plait bench {name}")


def _epilog() -> str:
    """The list of suites, for ``plait bench --help``."""
    width = max(map(len, SUITES))
    lines = [f"  {name:<{width}}  {suite.help}" for name, suite in SUITES.items()]
    return "\n".join(
        ["benchmark suites, each with its own flags (plait bench SUITE --help):", *lines]
    )


@dataclass(frozen=True, kw_only=True)
class BenchCommandConfig:
    """What ``plait bench`` (without a suite) compares: the schema of its flags
    (`plait.flags`); ``--config`` is the parser's, not a field: it names a file of them.

    The constructor checks what the values alone decide (ValueError naming the flag);
    `validate` checks the folders and every strategy against every workload.

    Attributes:
        workload: the workloads, comma-separated.
        strategies: the strategy specs, comma-separated (``;`` between specs whose
            options hold commas).
        cluster: the emulated cluster (one run per ``--bandwidth`` rate).
        steps: measured steps per strategy.
        warmup: discarded steps per strategy.
        batch_size: per-worker batch size (default: the workload's benchmark batch).
        out: output directory (results.json/.md/.png), None for none.
        trace: write a merged trace per job.
        tensorboard: also write each strategy's scalars as TensorBoard events here.
    """

    workload: str = option("resnet18", "workload(s), comma-separated")
    strategies: str = option(
        "ssgd",
        "strategy specs, comma-separated; use ; between specs whose options contain commas",
    )
    cluster: MultiRateClusterConfig = nested(MultiRateClusterConfig, group=CLUSTER_GROUP)
    steps: int = option(10, "measured steps per strategy")
    warmup: int = option(2, "discarded steps per strategy")
    batch_size: int | None = option(
        None, "per-worker batch size (default: the workload's benchmark batch)"
    )
    out: str | None = option(None, "output directory (results.json/.md/.png)")
    trace: bool = option(False, "write a merged trace per job")
    tensorboard: str | None = option(
        None,
        "also write each strategy's scalars (throughput, step time, bytes per step) "
        "as TensorBoard events here",
        metavar="DIR",
    )

    def __post_init__(self) -> None:
        int_at_least("--steps", self.steps, 1)
        int_at_least("--warmup", self.warmup, 0)
        int_at_least("--batch-size", self.batch_size, 1)

    def workloads(self) -> list[str]:
        """The workloads' names, in order."""
        return [w.strip() for w in self.workload.split(",") if w.strip()]


def add_parser(sub: Any) -> None:
    b = sub.add_parser(
        "bench",
        help="benchmark strategies side by side, or run a benchmark suite",
        epilog=_epilog(),
        formatter_class=ListingFormatter,
    )
    add_config_arg(b)
    add_options(b, BenchCommandConfig)


def validate(args: argparse.Namespace) -> None:
    cfg = build(args, BenchCommandConfig)
    args.placement = cfg.cluster.placement()  # the strategies' backend, checked below
    writable_dir("--out", cfg.out)
    check_tensorboard_dir(cfg.tensorboard)
    check_strategies(
        split_specs(cfg.strategies), workload_list(cfg.workload), cfg.cluster.world, args
    )


def run(args: argparse.Namespace) -> int:
    return run_config(build(args, BenchCommandConfig))


def run_config(cfg: BenchCommandConfig) -> int:
    """Run the comparison `cfg` describes: every strategy on every workload, at each
    ``--bandwidth`` rate."""
    from plait.bench.report import markdown_table, write_reports
    from plait.bench.runner import run_bench

    cluster = cfg.cluster
    out = Path(cfg.out) if cfg.out else None
    records = run_bench(
        workloads=cfg.workloads(),
        strategies=split_specs(cfg.strategies),
        nodes=cluster.nodes,
        nproc_per_node=cluster.nproc_per_node,
        bandwidths=cluster.bandwidths(),
        latency=cluster.latency,
        loss=cluster.loss,
        steps=cfg.steps,
        warmup=cfg.warmup,
        batch_size=cfg.batch_size,
        threads=cluster.threads,
        out=out,
        trace=cfg.trace,
    )
    if cfg.tensorboard:
        from plait.bench.runner import write_scalars

        write_scalars(records, Path(cfg.tensorboard))

    print(markdown_table(records))
    if out is not None:
        paths = write_reports(records, out)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
